"""examples/tunix_dpo.py's smoke run: Tunix's DPO demo in float32, bf16 and f16, one step overflowing.

The script's ``--quick`` run: a tiny random Gemma 3 of Tunix's class (one
layer) with qwix LoRA, 20 DPO steps of 8 synthetic preference pairs, the loss
multiplied by 1e4 at step 10. float16 must skip that step (the LoRA
parameters bit for bit unchanged across it, the scale halved from its initial
2**15) and train on; float32 and bfloat16 apply it. About 25 s on two CPU
cores, nearly all of it compiling Tunix's steps.

Tolerance: the DPO loss starts at log 2 (the LoRA's B matrices are zero, the
policy is the reference) and falls to 0.582 in the 20 steps; measured,
float16's final loss differs from float32's by 0.0008 (one update fewer, the
skipped one) and bfloat16's by 0.0003. Bound: 0.01, a tenth of what the
steps move it by.
"""

import math

import pytest

from example_scripts import load_example

pytest.importorskip("tunix")
pytest.importorskip("qwix")


# Tunix calls gc.collect() as it builds its trainers and learners.
pytestmark = pytest.mark.usefixtures("earlier_objects_frozen")


def test_tunix_dpo_quick_float16_skips_the_overflowing_step():
    out = load_example("tunix_dpo").main(["--quick"])
    runs, config = out["runs"], out["config"]
    spike = config["spike_step"]
    assert set(runs) == {"float32", "bf16", "f16"}
    for name, run in runs.items():
        assert len(run["losses"]) == config["steps"], name
        assert all(math.isfinite(x) for x in run["losses"]), name
        assert run["losses"][0] == pytest.approx(math.log(2), abs=1e-3), name
        assert run["losses"][-1] < run["losses"][0], name  # DPO trains, the spike notwithstanding
        assert run["losses"][spike] > 1e3, name  # the spike step's loss, times 1e4
        assert run["reward_accuracy"] >= 0.75, name  # of the last batch's 8 pairs; 1.0 measured
    assert runs["float32"]["model_class"] == "Gemma3"
    assert runs["bf16"]["model_class"] == runs["f16"]["model_class"] == "AmpGemma3"

    # float32 and bf16 apply the spike step; float16 skips it and halves the scale.
    assert not runs["float32"]["spike_params_unchanged"]
    assert not runs["bf16"]["spike_params_unchanged"]
    f16 = runs["f16"]
    assert f16["spike_params_unchanged"] and f16["spike_skipped"]
    assert f16["spike_scale_after"] == f16["spike_scale_before"] / 2
    assert f16["skipped_steps"] >= 1 and f16["loss_scale"] == f16["spike_scale_after"]

    assert f16["final_loss"] == pytest.approx(runs["float32"]["final_loss"], abs=0.01)
    assert runs["bf16"]["final_loss"] == pytest.approx(runs["float32"]["final_loss"], abs=0.01)
