"""`suggest_policy`: a precision policy to paste, read off a run's recorded statistics."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

from ._measure import LOSS_SCALE_EXPONENTS
from ._recorder import load_records

__all__ = ["PolicySuggestion", "Suggestion", "suggest_policy"]

_F16_MAX = 65504.0
_UNDERFLOW_TARGET = 0.01


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """One suggestion and why, with the numbers.

    Attributes:
        scope: the named scope path (or source line) it is about, or "" for the whole program.
        verdict: ``"keep_float32"``, ``"loss_scale"``, ``"no_loss_scale"``,
            ``"fp8_stable"`` or ``"fp8_unstable"``.
        reason: the figures that led to it.
        severity: for ordering: larger is more urgent.
    """

    scope: str
    verdict: str
    reason: str
    severity: float = 0.0


@dataclasses.dataclass(frozen=True)
class PolicySuggestion:
    """What `suggest_policy` found. ``str()`` is Python to paste, with the reasons as comments.

    Attributes:
        keep_float32: scopes whose forward values come within a factor of 2 of
            float16's largest value or underflow it (most urgent first).
        loss_scale: whether float16 needs loss scaling, and the range of scales
            that keeps cotangent underflow below 1% without overflow.
        scale_range: ``(low, high)`` exponents of that range (scales ``2^low``
            to ``2^high``), or None when no recorded scale does it.
        fp8: per scope with matmuls, whether its amax is stable enough for
            float8 (stable ones first).
        steps: the recorded steps the suggestion reads.
    """

    keep_float32: list[Suggestion]
    loss_scale: Suggestion | None
    scale_range: tuple[int, int] | None
    fp8: list[Suggestion]
    steps: list[int]

    @property
    def amp_policy_entries(self) -> dict[str, str]:
        """Scope name -> rule name, for ``jaxamp.default_amp_policy | {...}``.

        The table is keyed by `jax.named_scope` name: a path's innermost name
        (every scope of that name matches).
        """
        return {s.scope.split("/")[-1]: "use_original_precision" for s in self.keep_float32 if _is_named(s.scope)}

    def __str__(self) -> str:
        first, last = (self.steps[0], self.steps[-1]) if self.steps else (None, None)
        lines = [f"# jaxamp.monitoring.suggest_policy: from {len(self.steps)} recorded steps ({first} to {last})."]
        if self.keep_float32:
            lines.append("amp_policy = jaxamp.default_amp_policy | {")
            for s in self.keep_float32:
                name = s.scope.split("/")[-1]
                if _is_named(s.scope):
                    lines.append(f"    {name!r}: jaxamp.use_original_precision,  # {s.scope}: {s.reason}")
                else:
                    unnamed = f"{s.scope} has no named scope (wrap it in jax.named_scope to key it)"
                    lines.append(f"    # {unnamed}: {s.reason}")
            lines.append("}")
        else:
            lines.append("# No scope needs float32 for float16's range: amp_policy = jaxamp.default_amp_policy")
        if self.loss_scale is not None:
            lines.append(f"# Loss scaling: {self.loss_scale.reason}")
            if self.scale_range is not None:
                low, high = self.scale_range
                lines.append(
                    f"scaler = jaxamp.DynamicScalerState(scaler=2.0**{high}, min_scaler=2.0**{low}, "
                    f"max_scaler=2.0**{high})"
                )
        for s in self.fp8:
            lines.append(f"# fp8 {'stable' if s.verdict == 'fp8_stable' else 'UNSTABLE'}: {s.scope}: {s.reason}")
        return "\n".join(lines)


def _is_named(scope: str) -> bool:
    # Sites outside any named scope are labelled by source line: "file.py:12 (fn)".
    return not (scope.endswith(")") and ".py:" in scope)


def suggest_policy(records: Any, *, stable_bits: float = 1.0) -> PolicySuggestion:
    """Suggest a float16/float8 precision policy from a run's recorded statistics.

    * **float32 scopes**: scopes whose forward values (matmul operands and
      results, values handed on) reach within a factor of 2 of float16's
      largest value, 65504 (amax >= 32752: less than one bit of headroom),
      or have more than 1% of their nonzero entries below its smallest
      normal, as float16 would see them, whatever dtype the run itself used
      (near overflow first, then by the fraction lost).
    * **loss scaling**: from the cotangents' counts (the gradient matmuls'
      results and the values handed on in the backward pass) below float16's
      smallest normal under loss scales ``2^0, 2^6, 2^12, 2^18`` (relative
      to the scale each recorded step ran with, from the recorded loss-scale
      events),
      whether float16 needs loss scaling, and the range of scales that keeps
      the fraction of nonzero cotangents lost to underflow below 1% while
      the largest cotangent stays below half of 65504.
    * **fp8**: per scope, the largest rise of its matmul operands' amax
      between consecutive recorded steps (of the value quantised, for float8
      runs): a rise of more than `stable_bits` bits would overflow scales
      taken from an amax history (delayed scaling); keep such matmuls in
      bfloat16 or on current scaling.

    Args:
        records: a `MonitorRecorder`, its ``records``, or the JSON-lines file it wrote.
        stable_bits: the largest amax rise (in bits) between recorded steps
            that still counts as stable.

    Returns:
        A `PolicySuggestion`; ``print`` it for code to paste.

    Raises:
        ValueError: no statistics in `records`, or a negative `stable_bits`.
    """
    if not stable_bits >= 0:
        raise ValueError(f"stable_bits must be >= 0, got {stable_bits!r}.")
    records = load_records(records)
    stats = [r for r in records if r["kind"] == "stats"]
    if not stats:
        raise ValueError("suggest_policy: the records hold no statistics (record MonitorStats with a MonitorRecorder).")
    scales = sorted((r["step"], r["loss_scale"]) for r in records if r["kind"] == "loss_scale" and r["loss_scale"])
    return PolicySuggestion(
        keep_float32=_keep_float32(stats),
        **_loss_scaling(stats, scales),
        fp8=_fp8_stability(stats, stable_bits),
        steps=[r["step"] for r in stats],
    )


def _keep_float32(stats: list[dict]) -> list[Suggestion]:
    """Scopes float16 cannot hold: near its largest value, or mostly below its smallest normal."""
    largest: dict[str, tuple[float, int, str]] = {}
    underflow: dict[str, tuple[float, int, str]] = {}
    for record in stats:
        for site in record["sites"]:
            if site["direction"] != "forward" or not site["nonzero"] or site.get("handed_in"):
                continue  # (an operand another scope made is that scope's doing)
            scope, where = site["scope"], (record["step"], site["name"])
            # A float8 value's magnitudes are in scaled units: only the amax of
            # the value it quantises (when found) is the model's.
            amax = site["source_amax"] if site["fp8"] else (0.0 if _scaled(site) else site["amax"])
            if amax > largest.get(scope, (-1.0,))[0]:
                largest[scope] = (amax, *where)
            if _scaled(site):
                continue
            lost = site["below_2^-14"] / site["nonzero"]
            if lost > underflow.get(scope, (-1.0,))[0]:
                underflow[scope] = (lost, *where)
    found = {}
    for scope, (lost, step, name) in underflow.items():
        if lost > _UNDERFLOW_TARGET:
            found[scope] = Suggestion(
                scope, "keep_float32",
                f"{100 * lost:.1f}% of its nonzero forward values ({name}, step {step}) are below float16's "
                "smallest normal (6.1e-5), where float16 keeps fewer than its 11 bits",
                severity=lost,
            )  # fmt: skip
    for scope, (amax, step, name) in largest.items():
        if amax >= _F16_MAX / 2:  # overflow outranks underflow
            bits = math.log2(_F16_MAX / amax)
            found[scope] = Suggestion(
                scope, "keep_float32",
                f"forward amax {amax:.6g} ({name}, step {step}) is within a factor of 2 of float16's 65504 "
                f"({bits:.2f} bits of headroom)",
                severity=2.0 - bits,
            )  # fmt: skip
    return sorted(found.values(), key=lambda s: -s.severity)


def _loss_scaling(stats: list[dict], scales: list[tuple[int, float]]) -> dict[str, Any]:
    below: dict[float, float] = defaultdict(float)  # total scale exponent -> nonzero cotangents lost
    nonzero_at: dict[float, float] = defaultdict(float)
    largest, stored_f16 = 0.0, False
    for record in stats:
        run_exponent = math.log2(_scale_at(scales, record["step"]))
        for site in record["sites"]:
            if site["direction"] != "backward" or not site["nonzero"] or _scaled(site):
                continue
            if site["name"].endswith((".lhs", ".rhs")):
                continue  # a gradient matmul's other operand is a forward value: its results are the cotangents
            stored_f16 |= site["dtype"] == "float16"
            largest = max(largest, site["amax"] / 2.0**run_exponent)
            for e in LOSS_SCALE_EXPONENTS:
                below[run_exponent + e] += site[f"below_2^-{14 + e}"]
                nonzero_at[run_exponent + e] += site["nonzero"]
    if not nonzero_at:
        return dict(loss_scale=None, scale_range=None)
    fraction = {e: below[e] / nonzero_at[e] for e in sorted(nonzero_at)}
    unscaled = fraction.get(0.0)
    high = math.floor(math.log2(_F16_MAX / 2 / largest)) if largest > 0 else 24
    caveat = (
        " (the run stored cotangents in float16, so values already flushed to zero are not counted)"
        if stored_f16
        else ""
    )
    if unscaled is not None and unscaled < _UNDERFLOW_TARGET:
        reason = (
            f"not needed: {100 * unscaled:.2f}% of nonzero cotangents fall below float16's smallest normal "
            f"(2^-14) unscaled{caveat}"
        )
        return dict(loss_scale=Suggestion("", "no_loss_scale", reason), scale_range=None)
    good = [e for e, f in fraction.items() if f < _UNDERFLOW_TARGET and e <= high]
    described = ", ".join(f"{100 * f:.2f}% at 2^{e:g}" for e, f in fraction.items())
    described = f"nonzero cotangents below float16's smallest normal: {described}"
    if not good:
        reason = (
            f"needed, and no recorded scale keeps underflow below 1% without overflow: {described}; "
            f"scales above 2^{high} would overflow the largest cotangent ({largest:.3g}){caveat}"
        )
        return dict(loss_scale=Suggestion("", "loss_scale", reason, severity=1.0), scale_range=None)
    low = int(min(good))
    reason = (
        f"needed: {described}; the largest cotangent ({largest:.3g}, unscaled) stays below half of 65504 "
        f"up to 2^{high}: use scales 2^{low} to 2^{high}{caveat}"
    )
    return dict(loss_scale=Suggestion("", "loss_scale", reason, severity=1.0), scale_range=(low, int(high)))


def _scaled(site: dict) -> bool:
    """Whether a site's magnitudes are in float8's scaled units, not the model's."""
    return str(site["dtype"]).startswith("float8")


def _scale_at(scales: list[tuple[int, float]], step: int) -> float:
    current = 1.0
    for s, value in scales:
        if s > step:
            break
        current = value
    return current


def _fp8_stability(stats: list[dict], stable_bits: float) -> list[Suggestion]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for record in stats:
        per_scope: dict[str, float] = {}
        for site in record["sites"]:
            if site["direction"] != "forward" or site["name"].startswith("output[") or not site["values"]:
                continue
            if site["name"].endswith(".out"):
                continue  # what fp8 scales is the operands
            amax = site["source_amax"] if site["fp8"] else site["amax"]
            per_scope[site["scope"]] = max(per_scope.get(site["scope"], 0.0), amax)
        for scope, amax in per_scope.items():
            series[scope].append((record["step"], amax))
    found = []
    for scope, points in series.items():
        if len(points) < 2:
            continue
        rises = [
            (math.log2(b / a) if a > 0 and b > 0 else (math.inf if b > 0 else 0.0), s0, s1)
            for (s0, a), (s1, b) in zip(points, points[1:])
        ]
        rise, s0, s1 = max(rises)
        if rise > stable_bits:
            reason = (
                f"operand amax rose {rise:.2f} bits between recorded steps {s0} and {s1}: scales from an amax "
                "history would overflow; keep it on current scaling or in bfloat16"
            )
            found.append(Suggestion(scope, "fp8_unstable", reason, severity=rise))
        else:
            reason = (
                f"largest operand amax rise between recorded steps: {max(rise, 0.0):.2f} bits "
                f"(over {len(points)} steps)"
            )
            found.append(Suggestion(scope, "fp8_stable", reason, severity=rise))
    return sorted(found, key=lambda s: (s.verdict == "fp8_stable", -s.severity))  # worst rise first
