"""Policy configuration: one frozen dataclass, validated when built."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from dynoff.policy.geometry import GRANULE

HOMES = ("host", "device")  # dynoff.compile_pass.homes
PIN_HOMES = ("start", "first_raise")  # dynoff.compile_pass.placement

Estimator = Literal["measured", "model"]
Proxy = Literal["decode", "model"]
Rule = Literal["priced", "seed"]

# What each rule runs with when estimator / proxy are left unset.
RULE_DEFAULTS: dict[str, tuple[Estimator, Proxy]] = {
    "priced": ("model", "model"),
    "seed": ("measured", "decode"),
}


KV_LAYOUTS = ("auto", "packed", "per_layer")
DEFAULT_AUDIT_BASELINE_STEPS = 50  # PolicyConfig.audit_baseline_steps unset
# KV connectors the plugin coordinates with: vLLM's CPU KV offloading (--kv-offloading-size)
SUPPORTED_KV_CONNECTORS = ("OffloadingConnector",)


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Parameters of the offload policy and its estimators.

    Attributes:
        rule: ``"priced"`` (default): climb only when the best completely priced level in
            reach (k+1, k+2, k+4, ..., M: its exposed copies and piecewise penalty through
            the latency model, the stalls of changing in and out amortised over the hold
            horizon, and no more KV counted than the waiting requests need) beats the
            current one by ``climb_margin``; audit each climb by the tokens per second it
            served, and go back from a level that measured as a loss, with a growing
            back-off
            (:mod:`dynoff.policy.pricing`, :mod:`dynoff.policy.audit`). ``"seed"``: the
            seed's Algorithm 1 as written (an unmeasured level counts as free, so it
            explores upward under any queue).
        high_threshold: τ_h. KV utilisation above it (or any waiting request) is high pressure.
        low_threshold: τ_l. No waiting request and utilisation below it is low pressure.
        cooldown_steps: C. Steps after a level change during which no decision is taken.
        max_level: M. Highest offload depth; ``None`` means ⌊N/2⌋, or the largest level
            the host memory can pin if that is less (:meth:`resolve_max_level`).
        warmup: start at M and step down one level at a time, measuring each level.
        warmup_samples: decode-only steps averaged at each level during warm-up.
        estimator: where L_k comes from: ``"measured"`` (the seed's per-level averages) or
            ``"model"`` (the link-aware latency model, refined by measurements). Unset: the
            rule's (``model`` for ``priced``, ``measured`` for ``seed``).
        proxy: unset: the rule's (``model`` for ``priced``, ``decode`` for ``seed``).
            ``"decode"`` (the seed's C_k / L_k on decode-only steps) or ``"model"``
            (C_k / L_k with L_k the mean predicted step time over the last ``mix_steps``
            steps' compositions: the work a level will be held over, not one step).
        mix_steps: how many recent steps the ``model`` proxy prices (decode-only and
            prefill-carrying steps alike, in the proportions the server runs them).
        min_samples: measured steps at a level before its average replaces the model.
        drain_lag_steps: steps a fully drained group waits before it may be unmapped
            (async scheduling: a block freed at step N may be written by step N+1).
        drain_timeout_steps: steps a drain may wait for its blocks (held ones included)
            before it aborts with a log line and the policy decides again (2000: about a
            minute at 30 ms steps; long requests on the targets' blocks keep a drain open).
        report_timeout_steps: steps a command may wait for every rank's outcome (64).
            Past it, the level rank 0's reports show for steps run after the command
            settles it (applied or not), so a lost outcome never freezes the policy.
        descend_under_pressure: also step down while requests wait, when the level below
            serves more KV per ms (C_{k-1} / L_{k-1} > (1 + ``descend_margin``) · C_k / L_k,
            with level k measured ``min_samples`` times). The seed's Algorithm 1 only climbs
            under pressure, so a level that turns out to cost more than it gives stays until
            the queue clears. The tier then drains as its requests finish (and as vLLM
            preempts), with fewer blocks to admit meanwhile, instead of giving up when the free
            list runs dry. Off by default: not yet measured in serving on a GPU.
        descend_margin: how much more KV per ms the level below must serve (0.05 = 5%):
            hysteresis against noise in the two estimates.
        climb_margin: ``priced``: how much more KV per ms a higher level must serve. Unset:
            from the measured noise of the proxy (twice the standard error of the latency
            fit's mean over the mix), at least ``min_climb_margin``.
        min_climb_margin: the floor of the measured margin (0.01: a +0.3% edge never climbs).
        audit_window_steps: ``priced``: steps compared before and after each climb.
        audit_baseline_steps: ``priced``: the fewest saturated steps the window before a
            climb may hold (unset: 50, or the whole window if that is shorter). The window
            before is the longest saturated run among the last ``audit_window_steps``; a
            shorter one widens the verdict's noise bound by itself (batch means), and the
            first climb into a queue waits this many steps, not the whole window (200 steps
            are 6-8 s of queue on a 30-40 ms step).
        audit_settle_steps: steps skipped after a climb before its window opens.
        audit_tolerance: the smallest relative drop in tokens per second called a loss.
        loss_backoff_steps: after a level measured as a loss, steps before it may be tried
            again; doubled with each further loss at that level.
        max_calm_steps: ``priced``: at low pressure a level is left once the step time it
            costs over the level below, summed over the calm steps, has paid for the round
            trip (changing down now and back up when the pressure returns); left after this
            many calm steps in any case (2000: about a minute at 30 ms steps), so a level the
            model calls free is not held forever on its word.
    """

    high_threshold: float = 0.90
    low_threshold: float = 0.50
    cooldown_steps: int = 50
    max_level: int | None = None
    warmup: bool = False
    warmup_samples: int = 3
    rule: Rule = "priced"
    estimator: Estimator | None = None
    proxy: Proxy | None = None
    min_samples: int = 3
    mix_steps: int = 64
    drain_lag_steps: int = 2
    drain_timeout_steps: int = 2000
    report_timeout_steps: int = 64
    descend_under_pressure: bool = False
    descend_margin: float = 0.05
    climb_margin: float | None = None
    min_climb_margin: float = 0.01
    audit_window_steps: int = 200
    audit_baseline_steps: int | None = None
    audit_settle_steps: int = 10
    audit_tolerance: float = 0.02
    loss_backoff_steps: int = 1000
    max_calm_steps: int = 2000

    @property
    def audit_baseline(self) -> int:
        """The audit's baseline in steps (:attr:`audit_baseline_steps`, or its default)."""
        if self.audit_baseline_steps is not None:
            return self.audit_baseline_steps
        return min(DEFAULT_AUDIT_BASELINE_STEPS, self.audit_window_steps)

    def __post_init__(self) -> None:
        if self.rule not in RULE_DEFAULTS:
            raise ValueError(f"rule={self.rule!r}: use 'priced' (default) or 'seed'")
        estimator, proxy = RULE_DEFAULTS[self.rule]
        if self.estimator is None:
            object.__setattr__(self, "estimator", estimator)
        if self.proxy is None:
            object.__setattr__(self, "proxy", proxy)
        for name in ("high_threshold", "low_threshold"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name}={value} must lie in (0, 1); e.g. 0.9 and 0.5")
        if self.low_threshold >= self.high_threshold:
            raise ValueError(
                f"low_threshold={self.low_threshold} must be below "
                f"high_threshold={self.high_threshold}, or the policy would oscillate"
            )
        if self.cooldown_steps < 0:
            raise ValueError(f"cooldown_steps={self.cooldown_steps} must be >= 0")
        if self.max_level is not None and self.max_level < 0:
            raise ValueError(f"max_level={self.max_level} must be >= 0 (or None for N/2)")
        for name in ("warmup_samples", "min_samples", "mix_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.audit_window_steps < 10:
            raise ValueError(
                f"audit_window_steps={self.audit_window_steps} must be >= 10 (the audit "
                "compares 5 sub-windows of at least 2 steps each)"
            )
        baseline = self.audit_baseline_steps
        if baseline is not None and not 10 <= baseline <= self.audit_window_steps:
            raise ValueError(
                f"audit_baseline_steps={self.audit_baseline_steps} must be between 10 and "
                f"audit_window_steps ({self.audit_window_steps}): the window before a climb "
                "is at most the audit's window, and needs 5 sub-windows of 2 steps"
            )
        if self.drain_lag_steps < 0:
            raise ValueError(f"drain_lag_steps={self.drain_lag_steps} must be >= 0")
        if self.drain_timeout_steps < 1:
            raise ValueError(
                f"drain_timeout_steps={self.drain_timeout_steps} must be >= 1, e.g. 2000"
            )
        if self.report_timeout_steps < 1:
            raise ValueError(
                f"report_timeout_steps={self.report_timeout_steps} must be >= 1, e.g. 64"
            )
        for name in ("descend_margin", "min_climb_margin", "audit_tolerance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0, e.g. 0.05")
        if self.climb_margin is not None and self.climb_margin < 0:
            raise ValueError(f"climb_margin={self.climb_margin} must be >= 0 (or unset)")
        if self.audit_settle_steps < 0 or self.loss_backoff_steps < 0:
            raise ValueError("audit_settle_steps and loss_backoff_steps must be >= 0")
        if self.max_calm_steps < 1:
            raise ValueError(f"max_calm_steps={self.max_calm_steps} must be >= 1, e.g. 2000")
        if self.estimator not in ("measured", "model"):
            raise ValueError(f"estimator={self.estimator!r}: use 'measured' or 'model'")
        if self.proxy not in ("decode", "model"):
            raise ValueError(f"proxy={self.proxy!r}: use 'decode' or 'model'")

    def resolve_max_level(
        self, num_layers: int, layer_bytes: int, pinned_bytes_available: int | None
    ) -> int:
        """The max level for a model of ``num_layers`` equal layers, checked against ⌊N/2⌋
        and the host memory this rank may pin (each level pins two layers: the pair sharing
        one region). An explicit ``max_level`` that does not fit is refused; the default
        (``None``) takes the largest level that fits, up to ⌊N/2⌋.
        ``pinned_bytes_available=None`` leaves the memory unchecked."""
        if num_layers < 2:
            raise ValueError(
                f"dynamic offloading needs at least 2 decoder layers, got {num_layers}"
            )
        ceiling = num_layers // 2
        level = ceiling if self.max_level is None else self.max_level
        if level > ceiling:
            raise ValueError(
                f"max_level={level} exceeds N/2={ceiling} for a {num_layers}-layer model; "
                f"set max_level <= {ceiling}"
            )
        per_level = 2 * layer_bytes
        if pinned_bytes_available is None or per_level <= 0:
            return level
        fits = max(0, pinned_bytes_available) // per_level
        if level <= fits:
            return level
        if self.max_level is None:
            return fits
        raise ValueError(
            f"max_level={level} needs {level * per_level / 2**30:.1f} GiB of pinned host "
            f"memory ({2} layers of {layer_bytes / 2**30:.2f} GiB per level) but only "
            f"{max(0, pinned_bytes_available) / 2**30:.1f} GiB may be pinned; set "
            f"max_level <= {fits}, or leave it unset for the largest level that fits"
        )

    def fit_max_level(self, num_layers: int, shares: Sequence[HostShare]) -> int:
        """The one max level every rank can serve (``shares``: every rank's, in rank
        order; the same answer on every rank): the smallest of what each rank's host
        memory holds, :meth:`resolve_max_level` for each."""
        if not shares:
            raise ValueError("fit_max_level needs every rank's HostShare")
        budgets = HostShare.budgets(shares)
        try:
            return min(
                self.resolve_max_level(num_layers, share.layer_bytes, budget)
                for share, budget in zip(shares, budgets, strict=True)
            )
        except ValueError as e:
            if len(shares) == 1:
                raise
            raise ValueError(f"{e} (on the tightest of {len(shares)} ranks)") from e

    def capped_note(self, num_layers: int, shares: Sequence[HostShare], level: int) -> str | None:
        """What to tell the operator when the default max level (unset) came out below
        ⌊N/2⌋ for lack of host memory (``level``, from :meth:`fit_max_level`), or None: an
        explicit ``max_level`` is what was asked for."""
        if self.max_level is not None or level >= num_layers // 2:
            return None
        budgets = HostShare.budgets(shares)
        tightest = min(
            range(len(shares)), key=lambda r: budgets[r] // max(2 * shares[r].layer_bytes, 1)
        )
        share, budget = shares[tightest], budgets[tightest]
        where = f"rank {tightest}" if len(shares) > 1 else "this server"
        return (
            f"max level {level}, not {num_layers // 2}: {budget / 2**30:.1f} GiB of host memory "
            f"may be pinned for {where} ({share.available / 2**30:.1f} GiB available on "
            f"{share.host}, {round(100 * HOST_HEADROOM)}% kept free) and a level pins two "
            f'layers of {share.layer_bytes / 2**30:.2f} GiB; set "policy": {{"max_level": K}} '
            "to choose, or free host memory"
        )


# Host memory left unpinned: the OS, vLLM's own processes and its pinned staging buffers.
HOST_HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class HostShare:
    """One rank's view of its host at start-up, before any rank pins: the host's name,
    its available and total memory, the bytes of one of this rank's layers, and the bytes
    of host memory vLLM itself will pin for this rank later (a CPU KV tier's share)."""

    host: str
    available: int
    total: int
    layer_bytes: int
    reserved: int = 0

    @staticmethod
    def budgets(shares: Sequence[HostShare]) -> list[int]:
        """What each rank may pin: its host's available memory (the least any of the
        host's ranks saw), less ``HOST_HEADROOM`` of the host and what vLLM reserves there,
        split evenly between the ranks on that host, which pin at the same time."""
        hosts: dict[str, list[HostShare]] = {}
        for share in shares:
            hosts.setdefault(share.host, []).append(share)
        free = {
            host: min(s.available for s in ranks)
            - int(HOST_HEADROOM * max(s.total for s in ranks))
            - sum(s.reserved for s in ranks)
            for host, ranks in hosts.items()
        }
        return [max(0, free[s.host]) // len(hosts[s.host]) for s in shares]


def kv_tier_host_bytes(vllm_config: Any) -> int:
    """The host memory a CPU KV tier will pin, summed over the ranks
    (``cpu_bytes_to_use`` of ``--kv-offloading-size`` or ``--kv-transfer-config``); 0
    without one."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    try:
        return max(0, int(float(extra.get("cpu_bytes_to_use") or 0)))
    except (TypeError, ValueError):
        return 0


@dataclasses.dataclass(frozen=True)
class DynamicOffloadConfig:
    """Everything the plugin reads, from ``--additional-config '{"dynamic_offload": {...}}'``.

    Because it lives in vLLM's ``additional_config``, it is part of vLLM's compile-cache hash.

    Attributes:
        policy: Algorithm 1's parameters (nested dict ``"policy"``).
        trace_path: JSON-lines trace of every step and level change; ``None`` = no trace.
        level_schedule: ``((step, level), ...)``: force these levels from these steps on,
            bypassing the policy (tests, demos, benchmarks at a fixed level).
        level_file: a file holding one integer: while it exists, the scheduler forces that
            level (read every step; benchmarks steer the level from outside the engine).
        host_page_size: page size of the host VMM backend (CPU runs); CUDA uses its granularity
            (2 MiB) or, packed, the page :func:`~dynoff.policy.geometry.choose_page_size` picks.
        kv_layout: ``"auto"`` (default): ``"packed"`` wherever it applies, else
            ``"per_layer"`` (logged at start-up with the reason). ``"packed"``: vLLM's packed
            layout (one buffer, every layer's bytes of a block side by side), which lets a
            page span many blocks, so the weights and the KV tiers move on pages of tens of
            MiB and a level change needs ~15x fewer driver calls
            (:func:`dynoff.policy.geometry.choose_page_size`); it needs vLLM's V2 runner on
            CUDA, one KV cache group and an attention backend that indexes the KV by its
            block stride, and is refused elsewhere. ``"per_layer"``: one KV tensor per
            layer, as vLLM allocates them, on 2 MiB pages (a group is one page per layer).
        layer_bytes: bytes of one decoder layer's weights; ``None`` = computed from the
            model config (the worker checks it against the real parameters).
        h2d_GBps: host-to-device bandwidth for the ``model`` estimator. Unset (default):
            measured at start-up on the running engine (:mod:`dynoff.compile_pass.calibrate`);
            set it only to override the measurement.
        piecewise_penalty_ms: extra step time of the piecewise path while k > 0, for the
            ``model`` estimator. Unset (default): measured at start-up.
        measure_transfers: time every prefetch copy with CUDA events (benchmarks; read with
            ``LLM.collective_rpc("dynoff_stats")``). Off in serving: it adds two events per copy.
        home: where offloaded layers live between uses (:mod:`dynoff.compile_pass.homes`):
            ``"host"`` (default), pinned host memory; ``"device"``, GPU memory beyond
            ``gpu_memory_utilization``, an **emulation** of a fast CPU-GPU link on one GPU
            (benchmarks of the fast-link issue); it needs an explicit ``policy.max_level``,
            since the homes (two layers a level) must fit beyond the budget.
        home_GBps: pace every copy from a ``"device"`` home to this bandwidth (the emulated
            link: 390 for a GH200's NVLink-C2C); unset, the copies run at device speed.
        pin_homes: when the offloadable layers' host copies are page-locked.
            ``"first_raise"`` (default): each level's two when that level is first entered
            (level 1's at the start-up calibration). ``"start"``: all of them at start-up.
            Page-locked memory costs 2 MiB of device memory per GiB in the driver's page
            tables, which vLLM's profile takes from the KV cache when they are locked
            before it (0.11 GiB, 30 blocks, for Qwen3-32B's 58 GiB on an H100); locked at
            first entry, the levels never used cost none and the used ones take theirs from
            beyond the budget. The first entry into a level waits for its lock, once
            (39-64 ms per GiB on an H100: ~70-120 ms for two Qwen3-32B layers; logged, and
            priced by the policy).
        audit_changes: debug: around every level change, check on the device that the KV
            groups mapped before and after keep their bytes and every resident layer holds
            its own weights (:class:`~dynoff.compile_pass.levels.ChangeAudit`; ~20 ms a
            change for 50 GB of KV on an H100). What it finds is logged as an error and
            traced with the change (``audit``). Off in serving.
    """

    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    trace_path: str | None = None
    level_schedule: tuple[tuple[int, int], ...] = ()
    level_file: str | None = None
    host_page_size: int = GRANULE
    kv_layout: str = "auto"
    layer_bytes: int | None = None
    h2d_GBps: float | None = None
    piecewise_penalty_ms: float | None = None
    measure_transfers: bool = False
    home: str = "host"
    home_GBps: float | None = None
    pin_homes: str = "first_raise"
    audit_changes: bool = False

    KEY = "dynamic_offload"

    def __post_init__(self) -> None:
        steps = [step for step, _ in self.level_schedule]
        if steps != sorted(steps) or any(s < 0 or k < 0 for s, k in self.level_schedule):
            raise ValueError(
                "level_schedule must be [[step, level], ...] with increasing steps and "
                f"non-negative levels, got {list(self.level_schedule)}"
            )
        if self.h2d_GBps is not None and self.h2d_GBps <= 0:
            raise ValueError(f"h2d_GBps={self.h2d_GBps} must be > 0 (or unset: measured)")
        if self.piecewise_penalty_ms is not None and self.piecewise_penalty_ms < 0:
            raise ValueError(
                f"piecewise_penalty_ms={self.piecewise_penalty_ms} must be >= 0 (or unset)"
            )
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout={self.kv_layout!r}: use one of {KV_LAYOUTS}")
        if self.home not in HOMES:
            raise ValueError(f"home={self.home!r}: use one of {HOMES}")
        if self.pin_homes not in PIN_HOMES:
            raise ValueError(f"pin_homes={self.pin_homes!r}: use one of {PIN_HOMES}")
        if self.home_GBps is not None and (self.home != "device" or self.home_GBps <= 0):
            raise ValueError(
                f"home_GBps={self.home_GBps} paces the device home (the fast-link emulation): "
                'set "home": "device" and a bandwidth > 0, or leave home_GBps unset'
            )
        if self.home == "device" and self.policy.max_level is None:
            raise ValueError(
                'home "device" keeps two layers a level in GPU memory beyond '
                "gpu_memory_utilization, so the highest level must be chosen: set "
                '"policy": {"max_level": K} (the worker says which K fits if it does not)'
            )
        if self.host_page_size <= 0 or self.host_page_size % 4096:
            raise ValueError(f"host_page_size={self.host_page_size} must be a multiple of 4096")

    def forced_level(self, step: int) -> int | None:
        """The forced level at ``step`` (``level_file`` first, then ``level_schedule``), or
        None when the policy decides."""
        if self.level_file is not None:
            try:
                return max(0, int(Path(self.level_file).read_text().strip()))
            except (FileNotFoundError, ValueError):
                pass  # no file (or half-written): fall through
        level = None
        for start, scheduled in self.level_schedule:
            if step >= start:
                level = scheduled
        return level

    @classmethod
    def from_dict(cls, raw: dict[str, object] | None) -> DynamicOffloadConfig:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown dynamic_offload keys {unknown}; valid keys: {sorted(known)}")
        policy_raw = raw.pop("policy", {}) or {}
        if not isinstance(policy_raw, dict):
            raise ValueError("dynamic_offload.policy must be a JSON object")
        policy_known = {f.name for f in dataclasses.fields(PolicyConfig)}
        bad = sorted(set(policy_raw) - policy_known)
        if bad:
            raise ValueError(f"unknown policy keys {bad}; valid keys: {sorted(policy_known)}")
        schedule: Any = raw.pop("level_schedule", ()) or ()
        return cls(
            policy=PolicyConfig(**policy_raw),
            level_schedule=tuple((int(s), int(k)) for s, k in schedule),
            **raw,  # type: ignore[arg-type]
        )
