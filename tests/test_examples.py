"""Smoke tests of the examples and of the benchmark suite's measuring helpers.

The examples run with a handful of steps: these tests check that every mode
trains, stays finite and writes its outputs, not that the models are good (the
scripts' default runs check accuracy).
"""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from benchmarks import measure, report

from example_scripts import load_example


def test_digits_amp_trains_all_modes(tmp_path):
    digits_amp = load_example("digits_amp")
    # Batches of 32, half the default: a step costs about half (float8 is emulated on a CPU).
    # 20 steps at 3x the default learning rate: about as far as 40 at the default (73-79%
    # test accuracy measured; 67-84% with seeds 1 and 2), for half the steps. float16's
    # scale doubles every 5 finite steps, so it still overflows and skips a step (step 18).
    argv = ["--steps", "20", "--lr", "3e-3", "--batch-size", "32", "--out", str(tmp_path), "--patience", "5"]
    out = digits_amp.main(argv)
    runs = out["runs"]
    assert set(runs) == {"float32", "amp bf16", "amp f16 + loss scaling", "amp fp8"}
    for name, r in runs.items():
        assert len(r.losses) == 20, name
        assert all(math.isfinite(x) for x in r.losses[-10:]), name
        # Ten classes: chance is 10%; 20 steps of Adam get far above it.
        assert 50.0 < r.test_accuracy <= 100.0, (name, r.test_accuracy)
        assert r.nonfinite_params == 0, name
    scaled = runs["amp f16 + loss scaling"]
    assert len(scaled.loss_scales) == 20 and all(s > 0 for s in scaled.loss_scales)
    assert scaled.skipped_steps == len(scaled.skipped_at)
    assert out["plot"].exists() and out["plot"].stat().st_size > 0


# The tiny model of every char_lm test: the same flags give the same compiled programs
# (the session's compilation cache serves a mode's step, evaluation and sampling to
# the next test that runs it: compiling is nearly all of a test's time).
CHAR_LM_TINY = [
    "--steps", "3", "--print-every", "3", "--batch-size", "2", "--seq-len", "16",
    "--d-model", "16", "--layers", "2", "--heads", "2", "--corpus-bytes", "20000",
]  # fmt: skip
CHAR_LM_MODES = ["float32", "amp bf16", "amp f16", "bf16 kahan"]


@pytest.fixture(scope="module")
def char_lm_run(tmp_path_factory):
    """One run of every mode the two tests below check (each its own facts of it):
    ``(the example's module, what main returned, the plot's path)``."""
    char_lm = load_example("char_lm")
    plot = tmp_path_factory.mktemp("char_lm") / "curves.png"
    argv = [*CHAR_LM_TINY, "--sample-chars", "4", "--modes", ",".join(CHAR_LM_MODES), "--plot", str(plot)]
    return char_lm, char_lm.main(argv), plot


def test_char_lm_smoke(char_lm_run):
    char_lm, out, plot = char_lm_run
    assert list(out["val_loss"]) == CHAR_LM_MODES
    assert out["val_steps"] == [3] and plot.stat().st_size > 0
    for mode in CHAR_LM_MODES:
        assert len(out["train_loss"][mode]) == 3
        assert all(math.isfinite(x) for x in out["train_loss"][mode] + out["val_loss"][mode])
        # A prompt plus 4 sampled bytes (a byte may decode to U+FFFD).
        assert all(len(s) >= len("def ") + 1 for s in out["samples"][mode])
    # Same initialisation, same first batch: the first losses agree to bf16 accuracy.
    first = [out["train_loss"][m][0] for m in ("float32", "amp bf16", "bf16 kahan")]
    assert first[1] == pytest.approx(first[0], rel=0.02)
    assert first[2] == pytest.approx(first[0], rel=0.02)
    assert char_lm.parse_args([]).modes == ("float32", "amp bf16")  # the default runs
    with pytest.raises(SystemExit):
        char_lm.parse_args(["--modes", "amp bf16,bf16 rounding"])


def test_char_lm_float16_trains_with_the_scale_in_the_optimizer_state(char_lm_run):
    _, out, _ = char_lm_run
    losses = out["train_loss"]["amp f16"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses + out["val_loss"]["amp f16"])
    # Same initialisation, same first batch: float16 agrees with bfloat16 to bf16 accuracy.
    assert losses[0] == pytest.approx(out["train_loss"]["amp bf16"][0], rel=0.02)


def test_char_lm_monitor_writes_the_report_and_suggests_a_policy(tmp_path):
    char_lm = load_example("char_lm")
    # No sampled bytes: sampling is the smoke test's (it samples every mode), and monitoring
    # reaches only the training steps; without it no sampling program is compiled here.
    argv = [
        *CHAR_LM_TINY, "--sample-chars", "0", "--modes", "float32,amp bf16", "--monitor", str(tmp_path),
        "--monitor-every", "2",
    ]  # fmt: skip
    out = char_lm.main(argv)
    assert list(out["monitor"]) == ["amp bf16"]  # the float32 run is not an amp run
    report = out["monitor"]["amp bf16"]
    assert (tmp_path / "amp_bf16.html").stat().st_size > 0 and (tmp_path / "amp_bf16.png").stat().st_size > 0
    records = [json.loads(line) for line in (tmp_path / "amp_bf16.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 2]
    scopes = {s["scope"].split("/")[0] for r in records for s in r["sites"]}
    assert {"attention", "mlp", "lm_head"} <= scopes
    assert str(report["suggestion"]).startswith("# jaxamp.monitoring.suggest_policy: from 2 recorded steps")


def test_matmul_flops_counts_scan_bodies_and_dtypes():
    w = jnp.ones((3, 4), jnp.bfloat16)

    def f(x):
        def body(carry, _):
            return carry, (carry.astype(jnp.bfloat16) @ w)

        _, ys = jax.lax.scan(body, x, None, length=5)
        return jnp.einsum("bij,bjk->bik", x[None], x.T[None])  # batch 1, 2x3 @ 3x2

    flops = measure.matmul_flops(jax.make_jaxpr(f)(jnp.ones((2, 3))))
    assert flops["bfloat16"] == 5 * 2 * 2 * 4 * 3
    assert flops["float32"] == 2 * 2 * 2 * 3


def test_matmul_flops_of_a_convolution():
    lhs = jax.ShapeDtypeStruct((1, 2, 5, 5), jnp.float32)  # NCHW
    rhs = jax.ShapeDtypeStruct((4, 2, 3, 3), jnp.float32)  # OIHW
    conv = lambda x, k: jax.lax.conv(x, k, (1, 1), "VALID")  # noqa: E731
    flops = measure.matmul_flops(jax.make_jaxpr(conv)(lhs, rhs))
    # 4 output channels x 3x3 positions, each a 2x3x3 window.
    assert flops["float32"] == 2 * (4 * 3 * 3) * (2 * 3 * 3)


def test_residuals_and_converts():
    def f(w, x):
        return jnp.sum(jnp.sin(x @ w))

    w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    res = measure.residuals(f, w, x)
    # cos(x @ w) (4x8 float32) is saved for sin's derivative; w and x are
    # saved too (for the matmul's), but as arguments they are counted apart.
    assert res.saved_bytes == 4 * 8 * 4
    assert res.argument_bytes == (8 * 8 + 4 * 8) * 4
    text = jax.jit(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)).lower(x).as_text()
    assert measure.count_converts(text) == 2


def test_markdown_sections_are_replaced_by_label(tmp_path):
    md = tmp_path / "RESULTS.md"

    def results(label, value):
        return {
            "label": label,
            "machine": dict(
                backend="cpu",
                device="cpu",
                device_count=1,
                cpu="x",
                cpu_count=2,
                jax="0",
                jaxlib="0",
                python="3",
                date="today",
            ),  # fmt: skip
            "elapsed_s": 1.0,
            "command": "python -m benchmarks.run",
            "workloads": {"gpt": "GPT"},
            "models": {"gpt": {"f32": {"lower_s": value}, "amp_bf16": {"lower_s": 2 * value}}},
        }

    report.update_markdown(md, results("a", 1.0), tmp_path / "a.json", None)
    report.update_markdown(md, results("b", 1.0), tmp_path / "b.json", None)
    report.update_markdown(md, results("a", 3.0), tmp_path / "a.json", None)
    text = md.read_text()
    assert text.count("## a") == 1 and text.count("## b") == 1
    assert "| 3,000 |" in text and "| 1,000 |" in text  # a updated, b kept
    assert text.index("## a") < text.index("## b")
    assert "2.00x" in text


def test_tunix_grpo_quick():
    pytest.importorskip("tunix")
    tunix_grpo = load_example("tunix_grpo")
    out = tunix_grpo.main(["--quick"])  # f16 only: the table's f16 rows and one GRPO run
    assert set(out["gaps"]) == {"float32 everywhere", "amp f16 trainer only", "amp f16 both sides"}
    assert all(math.isfinite(g) and g >= 0 for g in out["gaps"].values())
    # float32 on both sides: the same program up to summation order; amp on the trainer alone rounds.
    assert out["gaps"]["float32 everywhere"] < 1e-4 < out["gaps"]["amp f16 trainer only"]
    assert out["agreement"]["float32 everywhere"] == 1.0
    (run,) = out["runs"].values()
    assert len(run["rewards"]) == 2 and run["skipped_steps"] == 0 and run["loss_scale"] > 0
