"""What the callback says in words to the person running the fit: the start message, and the warnings when the
plan runs short, a tensor was not profiled, or a step's importance was not finite.

Pure formatting of typed records (`records.Decision`, `records.StepTerms`), the plan (`planner.WallClockPlan`) and the
schedule; `reporting`, `session` and `terms` send them (`rank_zero_info`, `rank_zero_warn`).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_elastic import windows
from lightning_elastic.planner import FORECAST_STEPS, WallClockPlan
from lightning_elastic.profiling import TimingProfile
from lightning_elastic.reach import at_most
from lightning_elastic.records import Decision, StepTerms
from lightning_elastic.schedule import Schedule
from lightning_elastic.summary import MET_WITHIN


def start_message(
    profile: TimingProfile,
    speedup: float,
    total_steps: int | None,
    schedule: Schedule,
    run_on: int = 0,
    own_share: float | None = None,
    timed: bool = True,
) -> str:
    r"""What the fit starts with: the profile's figures (`timed` in this run, or read: cached, given, restored), the
    target and the schedule, the steps its first window may `run_on` while the process warms up
    (`warmup.FirstWindow.run_on_limit`), and elastic's own time as planned (`reach.Reach.own_share`; None: not
    known), said when it is over `windows.OWN_SHARE` as the summary rounds it.

    Example:
        >>> p = TimingProfile(names=("a",), t_dw=(0.002,), t_dy=(0.0,), t_fw=0.004, t_full=0.007,
        ...     device="cpu", fingerprint="f", unused=(), method="measured", numel=(9,))
        >>> print(start_message(p, 2.0, 120, Schedule(1, "epoch", 3)).replace("; ", "\n"))
        ElasticTensorSelection: 1 tensor profiled on cpu (full forward+backward 7.0 ms, forward 4.0 ms)
        target speedup 2 for the fit's 120 optimizer steps
        3 probe steps before the first selection, then 3 before every selection (one every 1 epoch(s))
    """
    steps = "steps (length unknown: planned per interval)" if total_steps is None else f"{total_steps} optimizer steps"
    more = f" (up to {run_on} more while this process warms up)" if run_on else ""
    own = ""
    if own_share is not None and own_share > windows.OWN_SHARE + 0.005:  # over 5% as the summary rounds it
        own = (
            f"; profiling and probe steps (full training steps that measure importance and the full step's time), "
            f"elastic's own time, are planned at {own_share:.0%} of this fit, above the {windows.OWN_SHARE:.0%} it "
            f"keeps to in longer fits with automatic `probe_steps`: they count toward the {speedup:g}x, so the "
            "selected steps have less time"
        )
    profiled = "profiled" if timed else "profiled earlier (a profile read, not timed in this run)"
    return (
        f"ElasticTensorSelection: {_count(len(profile.names), 'tensor')} {profiled} on {profile.device} (full "
        f"forward+backward {profile.t_full * 1e3:.1f} ms, forward {profile.t_fw * 1e3:.1f} ms); target speedup "
        f"{speedup:g} for the fit's {steps}; {_count(schedule.first_steps, 'probe step')} before the first selection"
        f"{more}, {_later(schedule)}{own}"
    )


def _per_step(target: float) -> str:
    """A step target in words: "12.5 ms a step", or none when the plan has spent more than it had (a target below 0).

    Example:
        >>> _per_step(0.0125), _per_step(-0.0098)
        ('12.5 ms a step', 'no time for the steps ahead')
    """
    return f"{target * 1e3:.1f} ms a step" if target >= 0 else "no time for the steps ahead"


def _count(n: int, thing: str) -> str:
    """`n` things, in words: "1 tensor", "3 tensors"."""
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _later(schedule: Schedule) -> str:
    """The windows before the selections after the first, in words: none where `probe_every` skips them all.

    Example:
        >>> _later(Schedule(1, "epoch", 1, steps_per_epoch=32, probe_every=4, total_steps=128))
        'no window before the 3 selections after it (one every 1 epoch(s))'
        >>> _later(Schedule(20, "step", 1, probe_every=3))
        'then 1 before one selection in 3 (one every 20 step(s))'
    """
    later = None if schedule.selections is None else schedule.selections - 1
    every = f"(one every {schedule.interval} {schedule.unit}(s))"
    if later is not None and schedule.probe_every > later:
        return f"no window before the {_count(later, 'selection')} after it {every}"
    which = "every selection" if schedule.probe_every == 1 else f"one selection in {schedule.probe_every}"
    return f"then {schedule.probe_steps} before {which} {every}"


def unprofiled_warning(names: Sequence[str]) -> str:
    """The warning when tensors the profiled batch did not use get a gradient: they train outside every selection.

    Example:
        >>> unprofiled_warning(["b.weight", "b.bias"])[:75]
        'ElasticTensorSelection: tensors that the profiled batch did not use got a g'
    """
    return (
        "ElasticTensorSelection: tensors that the profiled batch did not use got a gradient (a branch of the model "
        f"that batch did not take): {list(names)[:5]}{' ...' if len(names) > 5 else ''}. They are not in the profile, "
        "so no selection freezes them: they train whenever a batch uses them, outside the selection (the plan counts "
        "their time in the steps it measures). Freeze them with `train_never` if they should not train."
    )


def nonfinite_warning(names: Sequence[str], dropped: Sequence[int]) -> str:
    """The warning, once a fit, when some tensor steps' importance was not finite (`dropped`: their count per tensor).

    Example:
        >>> nonfinite_warning(["a", "b"], [0, 3])[:80]
        "ElasticTensorSelection: the importance of ['b'] was not finite at 3 tensor steps"
    """
    named = [n for n, d in zip(names, dropped, strict=True) if d][:5]
    return (
        f"ElasticTensorSelection: the importance of {named} was not finite at {sum(dropped)} tensor steps (a NaN or "
        "inf gradient or update): those steps are left out and each tensor keeps its last finite importance. Counted "
        "as `nonfinite_steps` in the summary; warned once a fit."
    )


def starved_warning(
    step: int,
    decision: Decision,
    terms: StepTerms,
    plan: WallClockPlan,
    schedule: Schedule,
    required: Sequence[bool],
    forbidden: Sequence[bool],
) -> str:
    """The warning when even the cheapest selection takes longer than the plan's step target (`FitSession.say_starved`
    says when): once `T` is measured, with what the whole fit reaches at that selection for every step left and the
    probe steps of `schedule` ahead (`WallClockPlan.reachable`), measured where the check before training had only
    the profile; from fewer than `FORECAST_STEPS` selected steps, said to be an early figure."""
    largest = terms.model.max_speedup(required, forbidden, terms.full)
    reachable = None
    if plan.full_samples and plan.total_steps is not None:
        ahead = schedule.probe_steps_between(step, plan.total_steps)
        reachable = plan.reachable(step, ahead, plan.expected(decision.predicted_seconds))
    if reachable is None:
        outcome = (
            "Later intervals pay it back if they can: the summary's `fit_speedup` is the outcome."
            if plan.total_steps is None
            else "Later intervals pay it back if they can; what the whole fit can reach is said once a probe window "
            "has measured the full step."
        )
    elif reachable < plan.speedup * (1 - MET_WITHIN):
        ask = "ask at most that, or fit longer" if reachable > 1 else "a `speedup` must be above 1: fit longer"
        outcome = (
            "With the cheapest selection at every step left, at the step times measured so far, this fit reaches "
            f"about {at_most(reachable)}x: the `speedup` asked is out of its reach ({ask})."
        )
    elif reachable < plan.speedup:
        outcome = (
            "With the cheapest selection at every step left, at the step times measured so far, this fit reaches "
            f"about {at_most(reachable)}x: within the {MET_WITHIN:.0%} of the asked that the summary counts as met, "
            "with nothing to spare."
        )
    else:
        outcome = (
            "Later intervals can pay it back: at the cheapest selection, at the step times measured so far, this fit "
            f"reaches about {at_most(reachable)}x."
        )
    if reachable is not None and (n := plan.selected_samples) < FORECAST_STEPS:
        basis = f"{n} selected step{'s' * (n != 1)}" if n else "the time model, before any selected step"
        outcome += (
            f" An early figure, from {basis} (a fit's first ones can run far slower than its later ones): said again "
            f"if the cheapest selection is still over the plan once {FORECAST_STEPS} selected steps are measured."
        )
    return (
        f"ElasticTensorSelection: at step {step} the plan leaves {_per_step(decision.target_seconds)} "
        f"(full step {terms.full * 1e3:.1f} ms, {plan.spent:.1f} s spent of {plan.planned():.1f} s planned); "
        f"the cheapest selection takes {decision.predicted_seconds * 1e3:.1f} ms, so this interval spends more "
        f"than its share of `speedup` {plan.speedup!r} (largest per-step speedup: {at_most(largest)}x). {outcome}"
    )
