"""The monitor over a run: `MonitorRecorder`, `monitor_report`, `suggest_policy`, against `compare`.

The model has one deliberately badly scaled layer, ``"tiny"``: its (fixed)
weights are 1e-5 of the others', so in float16 most of what it hands on sits
below float16's smallest normal (6.1e-5) until the next layer scales it back. The report, `compare` and `suggest_policy`
must each name it first.
"""

import html.parser
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl  # to count reads (see the first test)

import jaxamp

WIDTH = 16


TINY = jax.random.normal(jax.random.key(7), (WIDTH, WIDTH)) * 1e-5 / 4  # fixed, badly scaled weights
LAST = jax.random.normal(jax.random.key(8), (WIDTH, WIDTH)) * 1e4 / 4  # fixed: they scale it back


def init(key):
    return {"first": jax.random.normal(key, (WIDTH, WIDTH)) / 4}


def loss(params, x):
    with jax.named_scope("first"):
        h = jnp.tanh(x @ params["first"])
    with jax.named_scope("tiny"):
        h = h @ TINY
    with jax.named_scope("last"):
        y = h @ LAST
    return jnp.mean((y - 0.5) ** 2)


def train(steps=6, every=2, path=None, tensorboard_dir=None):
    """A few float16 steps with dynamic loss scaling, monitored and recorded."""
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss, compute_dtype="f16"))

    @jax.jit
    @jaxamp.monitoring.monitor
    def step(state, params, x):
        state, (value, grads) = grad_fn(params, x, dynamic_scaler_state=state)
        params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
        return state, params, value, jaxamp.all_finite(grads)

    state = jaxamp.DynamicScalerState(scaler=4.0, patience=2)
    recorder = jaxamp.monitoring.MonitorRecorder(every=every, path=path, tensorboard_dir=tensorboard_dir)
    for i in range(steps):
        (next_state, params, value, finite), stats = step(state, params, x)
        recorder.record(i, stats, loss_scale=state, finite=finite)  # the scale the step ran with
        state = next_state
    return recorder, params, x


def test_the_recorder_makes_no_host_transfer_per_step(monkeypatch):
    params = init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    step = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(jaxamp.amp(loss, compute_dtype="f16"))))
    recorder = jaxamp.monitoring.MonitorRecorder(every=1, flush_every=5)
    scale = jnp.float32(1024.0)
    # XLA's CPU backend does not guard device-to-host copies (its arrays are in
    # host memory), so reads are counted where every read of an array's value
    # goes through; the transfer guard still catches host-to-device copies.
    reads = []
    value_of = ArrayImpl._value
    monkeypatch.setattr(ArrayImpl, "_value", property(lambda a: reads.append(a.shape) or value_of.fget(a)))
    for i in range(4):
        (value, grads), stats = step(params, x)
        finite = jnp.isfinite(value)
        reads.clear()
        with jax.transfer_guard("disallow"):
            recorder.record(i, stats, loss_scale=scale, finite=finite)
        assert reads == [] and recorder.records == []  # nothing read
    (value, grads), stats = step(params, x)
    recorder.record(4, stats, loss_scale=scale)  # the fifth fills the batch: read
    assert reads and len(recorder.records) == 6
    assert [r["step"] for r in recorder.records if r["kind"] == "stats"] == [0, 1, 2, 3, 4]
    assert [r["event"] for r in recorder.records if r["kind"] == "loss_scale"] == ["start"]


def test_records_hold_every_nth_step_loss_scale_events_and_json_lines(tmp_path):
    path = tmp_path / "monitor.jsonl"
    recorder, _, _ = train(steps=6, every=2, path=path)
    recorder.close()
    on_disk = [json.loads(line) for line in path.read_text().splitlines()]
    assert on_disk == json.loads(json.dumps(recorder.records))
    assert [r["step"] for r in on_disk if r["kind"] == "stats"] == [0, 2, 4]
    events = [(r["step"], r["event"], r["loss_scale"]) for r in on_disk if r["kind"] == "loss_scale"]
    assert events == [(0, "start", 4.0), (3, "change", 8.0)]  # grown after 2 finite steps (patience)
    sites = on_disk[0]["sites"] if on_disk[0]["kind"] == "stats" else on_disk[1]["sites"]
    assert {"forward", "backward"} == {s["direction"] for s in sites}


def test_tensorboard_gets_each_sites_headroom_and_the_loss_scale(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboardX.proto.event_pb2 import Event

    recorder, _, _ = train(steps=4, every=2, tensorboard_dir=tmp_path)
    recorder.close()
    scalars = {}
    for path in tmp_path.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        while data:  # TFRecord framing: length, its CRC, the record, its CRC
            length = int.from_bytes(data[:8], "little")
            event = Event.FromString(data[12 : 12 + length])
            data = data[16 + length :]
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    assert scalars["loss_scale"][0] == (0, 4.0)
    assert "monitor/forward/tiny/dot_general_0.out/underflow" in scalars
    assert [step for step, _ in scalars["monitor/forward/first/dot_general_0.out/headroom_bits"]] == [0, 2]


def test_the_badly_scaled_layer_is_named_first_by_the_report_compare_and_suggest_policy(tmp_path):
    recorder, params, x = train(steps=6, every=1)
    _, summaries, _, _ = jaxamp.monitoring.summarize(recorder)
    assert summaries[0].scope == "tiny" and summaries[0].underflow > 0.5

    page = jaxamp.monitoring.monitor_report(recorder, tmp_path / "report.html")
    cells = _table_cells(open(page).read())
    assert cells[0][1] == "tiny"

    suggestion = jaxamp.monitoring.suggest_policy(recorder)
    assert suggestion.keep_float32[0].scope == "tiny"
    assert "below float16's smallest normal" in suggestion.keep_float32[0].reason
    assert "'tiny': jaxamp.use_original_precision" in str(suggestion)
    pasted = {"jaxamp": jaxamp}
    exec(str(suggestion), pasted)  # what it prints is Python to paste
    assert pasted["amp_policy"]["tiny"] is jaxamp.use_original_precision
    assert suggestion.amp_policy_entries == {"tiny": "use_original_precision"}

    comparison = jaxamp.compare(loss, compute_dtype="f16")(params, x)
    assert comparison.scopes[0].scope == "tiny"


def test_the_png_report_has_its_size_and_pixels(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.image

    recorder, _, _ = train(steps=4, every=1)
    image = matplotlib.image.imread(jaxamp.monitoring.monitor_report(recorder, tmp_path / "report.png"))
    height, width = image.shape[:2]
    assert width == 1400 and height > 400
    assert np.mean(image[..., :3] < 0.9) > 0.02  # drawn, not blank


def _site(direction, scope, name, **fields):
    site = dict(direction=direction, scope=scope, name=name, dtype="bfloat16", fp8=False, handed_in=False,
                amax=1.0, source_amax=0.0, scale=0.0, values=100.0, nonzero=100.0, underflow=0.0, above=0.0,
                nonfinite=0.0, **{f"below_2^-{14 + e}": 0.0 for e in (0, 6, 12, 18)})  # fmt: skip
    return site | fields


def test_suggest_policy_reads_the_loss_scale_range_from_cotangents():
    # Cotangents of largest magnitude 2 (at scale 1): scales up to 2^13 keep them
    # below half of 65504. Half their nonzero entries are below 2^-14, 5% below
    # 2^-20, none below 2^-26: a scale of 2^12 is the smallest recorded one with
    # less than 1% lost. A gradient matmul's forward operand (its huge amax) is
    # not a cotangent and must not narrow the range.
    cotangent = _site("backward", "layer", "dot_general[0].out", amax=2.0,
                      **{"below_2^-14": 50.0, "below_2^-20": 5.0})  # fmt: skip
    operand = _site("backward", "layer", "dot_general[0].rhs", amax=1e6, **{"below_2^-14": 100.0})
    records = [
        dict(kind="loss_scale", step=0, loss_scale=1.0, skipped=False, event="start"),
        dict(kind="stats", step=0, headroom_bits=4.0, sites=[cotangent, operand]),
    ]
    suggestion = jaxamp.monitoring.suggest_policy(records)
    assert suggestion.loss_scale.verdict == "loss_scale" and suggestion.scale_range == (12, 13)
    assert "50.00% at 2^0, 5.00% at 2^6, 0.00% at 2^12" in suggestion.loss_scale.reason
    pasted = {"jaxamp": jaxamp}
    exec(str(suggestion), pasted)  # what it prints is Python to paste
    assert float(pasted["scaler"].min_scaler) == 2.0**12 and float(pasted["scaler"].max_scaler) == 2.0**13
    # Recorded at a loss scale of 2^10, the counts are relative to it: 5% lost
    # at 2^10, none at 2^16, but 2^16 would overflow (2048 / 2^10 = 2 unscaled).
    scaled = dict(cotangent, amax=2.0 * 2**10, **{"below_2^-14": 5.0, "below_2^-20": 0.0})
    records = [dict(records[0], loss_scale=2.0**10), dict(records[1], sites=[scaled])]
    at_scale = jaxamp.monitoring.suggest_policy(records)
    assert at_scale.scale_range is None
    assert "5.00% at 2^10, 0.00% at 2^16" in at_scale.loss_scale.reason
    assert "scales above 2^13 would overflow the largest cotangent (2)" in at_scale.loss_scale.reason


def test_fp8_stability_flags_a_jumping_amax():
    def record(step, amax):
        site = _site("forward", "proj", "dot_general[0].lhs", amax=amax)
        steady = dict(site, scope="steady", amax=1.0)
        return dict(kind="stats", step=step, headroom_bits=4.0, sites=[site, steady])

    suggestion = jaxamp.monitoring.suggest_policy([record(0, 1.0), record(10, 1.2), record(20, 9.0)])
    assert [(s.scope, s.verdict) for s in suggestion.fp8] == [("proj", "fp8_unstable"), ("steady", "fp8_stable")]
    assert "2.91 bits between recorded steps 10 and 20" in suggestion.fp8[0].reason


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="every must be a positive integer"):
        jaxamp.monitoring.MonitorRecorder(every=0)
    with pytest.raises(TypeError, match="stats must be the MonitorStats"):
        jaxamp.monitoring.MonitorRecorder().record(0, {"not": "stats"})
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        jaxamp.monitoring.monitor_report([], "report.pdf")
    with pytest.raises(ValueError, match="no statistics"):
        jaxamp.monitoring.suggest_policy([])


def _table_cells(page):
    class Cells(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.in_body, self.in_cell = [], False, False

        def handle_starttag(self, tag, attrs):
            self.in_body |= tag == "tbody"
            if self.in_body and tag == "tr":
                self.rows.append([])
            self.in_cell = self.in_body and tag == "td"

        def handle_endtag(self, tag):
            self.in_body &= tag != "tbody"
            self.in_cell &= tag != "td"

        def handle_data(self, data):
            if self.in_cell:
                self.rows[-1].append(data)

    parser = Cells()
    parser.feed(page)
    parser.close()
    assert parser.rows, "the report has no table rows"
    return parser.rows
