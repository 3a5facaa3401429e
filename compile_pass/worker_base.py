"""The worker side of dynamic offloading, shared by the CUDA and CPU worker classes.

* ``load_model``: after vLLM loads the weights, pack every decoder layer into a VMM range
  (:class:`~dynoff.compile_pass.placement.WeightPlacement`), pin the offloadable layers'
  CPU copies and install the prefetch engine the custom ops call.
* ``determine_available_memory``: report the KV bytes of the *highest* level's capacity, so
  vLLM sizes ``num_blocks`` once for good; only level 0's groups get physical pages.
* ``initialize_from_config``: KV tensors are VMM reservations (HACK, see :mod:`.hacks`).
* ``execute_model``: apply the scheduler's :class:`OffloadCommand` before the forward
  (raise: alias the layer, map its freed pages into the KV groups; lower: unmap the groups
  after the device is idle, restore the layer), time the forward, and report back.

Concrete classes: ``dynoff.compile_pass.worker.DynamicOffloadWorker`` (CUDA) and
``dynoff.compile_pass.cpu_worker.CPUDynamicOffloadWorker`` (vLLM's CPU engine). They live in
separate modules because importing vLLM's CPU worker replaces ``torch.cuda.Event`` and
friends process-wide (``vllm/v1/worker/cpu/shm.py``), which breaks CUDA (seen on the H200).
"""

from __future__ import annotations

import copy
import dataclasses
import socket
import time
from typing import Any, TypeVar

import psutil
import torch
from torch import nn
from vllm.config import CompilationMode
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, ModelRunnerOutput

from dynoff.allocator import VmmArena
from dynoff.allocator.kv_cache import VmmKVCache
from dynoff.compile_pass import calibrate, hacks, homes, runtime
from dynoff.compile_pass.config import Route, compile_route
from dynoff.compile_pass.fx_pass import LAYER_PREFETCH_PASS
from dynoff.compile_pass.levels import LevelChanger, gather_all
from dynoff.compile_pass.placement import WeightPlacement
from dynoff.compile_pass.prefetch import PrefetchEngine
from dynoff.compile_pass.timing import StepTimer, Timed
from dynoff.policy.config import (
    SUPPORTED_KV_CONNECTORS,
    DynamicOffloadConfig,
    HostShare,
    kv_tier_host_bytes,
)
from dynoff.policy.geometry import (
    CapacityPlan,
    KVLayout,
    check_planned_layer,
    choose_page_size,
    packed_kv_cache_config,
    plan_capacity,
    plan_report,
    planned_layer_bytes,
    recover_plan,
    resolve_kv_layout,
    uses_v2_runner,
)
from dynoff.policy.latency import StepShape, prefill_pairs
from dynoff.policy.messages import (
    RUNNER_OUTPUT_ATTR,
    SCHEDULER_OUTPUT_ATTR,
    Calibration,
    PlanReport,
    ResizeOutcome,
    StepReport,
)
from dynoff.policy.status import board_dir, publish_max_level

logger = init_logger("vllm.dynoff.worker")
T = TypeVar("T")
LINK_REPORT_STEPS = 128  # steps between reports of the emulated link's serving bandwidth


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the longest ``nn.ModuleList`` named ``layers``."""
    best: nn.ModuleList | None = None
    for name, module in model.named_modules():
        is_layers = isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers"
        if is_layers and (best is None or len(module) > len(best)):
            best = module
    if best is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers named `layers`")
    return best


STEERABLE_MODES = ("NONE", "PIECEWISE", "FULL_AND_PIECEWISE")


def check_gpu_config(vllm_config: Any) -> None:
    """Refuse what the plugin cannot serve correctly, with the reason and the fix."""
    if vllm_config.model_config.enable_sleep_mode:
        raise ValueError(
            "dynamic offload owns the weights' and KV cache's memory through CUDA VMM; "
            "vLLM's sleep mode (CuMemAllocator) would free it underneath: drop --enable-sleep-mode"
        )
    dp = getattr(vllm_config.parallel_config, "data_parallel_size", 1)
    if dp > 1:
        raise ValueError(
            f"data_parallel_size={dp}: dynamic offload has not been tested with data "
            "parallelism (each replica would run its own policy); run one vllm serve per "
            "replica behind a load balancer, or drop --data-parallel-size"
        )
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if kv_dtype.startswith("fp8"):
        raise ValueError(
            f"kv_cache_dtype={kv_dtype}: KV pages handed over from weights carry weight bytes, "
            "and some are NaN patterns in fp8; until a GPU test shows the attention backends "
            "never read them, dynamic offload refuses an fp8 KV cache: use --kv-cache-dtype auto"
        )
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.name not in STEERABLE_MODES:
        raise ValueError(
            f"cudagraph_mode={mode.name}: with k > 0 the plugin must route steps to piecewise "
            f"graphs, which this mode does not capture; use one of {STEERABLE_MODES} "
            "(the default FULL_AND_PIECEWISE keeps FULL decode graphs at k = 0)"
        )


def check_features(vllm_config: Any) -> None:
    """Refuse vLLM features the plugin has not been tested with, on any platform, with the
    fix. Speculative decoding: a draft model (EAGLE, MTP, a smaller model) is compiled with
    the same compilation config, so the layer pass would put the target's offload ops into
    the draft's graph, and every method changes the steps' shapes the policy prices. LoRA:
    adapters are written into the decoder layers while serving, which the layers' host
    copies never see. vLLM's own weight offloading (UVA or prefetch) moves the same
    layers' weights. Quantized weights: no quantized model has been run with it, and a
    method may keep weights or scales outside the layers' parameters, which the packing
    never sees (it keeps each parameter's own strides)."""
    offload = getattr(vllm_config, "offload_config", None)
    if offload is not None and (
        offload.uva.cpu_offload_gb > 0 or offload.prefetch.offload_group_size > 0
    ):
        raise ValueError(
            "vLLM's own weight offloading (--cpu-offload-gb, or --offload-group-size) moves "
            "the same decoder layers' weights that dynamic offload packs and offloads by "
            "level: drop those flags and let the plugin's policy choose the depth, or serve "
            "without the plugin"
        )
    quantization = getattr(getattr(vllm_config, "model_config", None), "quantization", None)
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization} has not been tested with dynamic offload: a "
            "quantization method may keep weights or scales outside the layers' parameters, "
            "which an offloaded layer would not carry; serve an unquantized checkpoint, or "
            "serve without the plugin"
        )
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        method = getattr(spec, "method", None) or "a draft model"
        raise ValueError(
            f"speculative decoding ({method}) has not been tested with dynamic offload: a "
            "draft model would be compiled with the offload ops and the policy prices steps "
            "without speculative tokens; drop --speculative-config, or serve without the plugin"
        )
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError(
            "LoRA has not been tested with dynamic offload: adapters are loaded into the "
            "decoder layers while serving, and an offloaded layer is copied back from its "
            "host copy made at start-up; drop --enable-lora, or serve without the plugin"
        )


def check_kv_connector(vllm_config: Any) -> None:
    """Refuse a KV connector the plugin cannot coordinate with (``--kv-transfer-config``, or
    ``--kv-offloading-size``, which vLLM turns into one). vLLM's own CPU KV offloading, the
    ``OffloadingConnector``, is supported: it copies blocks through the KV tensors the
    plugin allocates in its VMM ranges (fixed addresses, per layer or packed), and the
    scheduler keeps the blocks it is still copying out mapped
    (:func:`dynoff.policy.hacks.kv_connector_reads`). Other connectors register or
    allocate the KV cache in ways the plugin has not been shown to survive."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    connector = getattr(transfer, "kv_connector", None) if transfer is not None else None
    if connector and connector not in SUPPORTED_KV_CONNECTORS:
        raise ValueError(
            f"kv_connector={connector}: dynamic offload grows and shrinks the KV cache's "
            "memory through CUDA VMM and supports only vLLM's CPU KV offloading "
            f"({', '.join(SUPPORTED_KV_CONNECTORS)}: --kv-offloading-size N, with "
            "VLLM_USE_SIMPLE_KV_OFFLOAD unset); drop --kv-transfer-config, or serve without "
            "the plugin"
        )


def check_compile_config(compilation_config: Any) -> Route:
    """The compilation route, or the reason the layer ops would never run."""
    if compilation_config.mode == CompilationMode.NONE:
        raise ValueError(
            "dynamic offload inserts its ops with torch.compile; compilation mode NONE "
            "(--enforce-eager) cannot run it"
        )
    route = compile_route(compilation_config)
    if route is None:
        raise ValueError(
            "dynamic offload needs its layer pass in the compilation config, in the form this "
            f"compilation mode ({compilation_config.mode.name}) runs, or offloaded layers "
            "would run on another layer's weights: pass -cc \"$(python -m "
            'dynoff.compile_pass.config)" (Python: compilation_config='
            "dynoff_compilation_config()), which picks the route for the platform"
        )
    return route


def with_report(output: Any, report: StepReport) -> Any:
    if not isinstance(output, ModelRunnerOutput):
        return output
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy.copy(output)  # never mutate vLLM's shared empty output
    setattr(output, RUNNER_OUTPUT_ATTR, report)
    return output


@dataclasses.dataclass
class _State:
    config: DynamicOffloadConfig
    arena: VmmArena
    placement: WeightPlacement
    engine: PrefetchEngine
    runtime: runtime.OffloadRuntime
    plan: CapacityPlan | None = None
    layout: KVLayout | None = None
    kv: VmmKVCache | None = None
    levels: LevelChanger | None = None
    outcomes: list[ResizeOutcome] = dataclasses.field(default_factory=list)
    step: int = -1
    calibration: Calibration | None = None  # sent once, on the next report
    plans: tuple[PlanReport, ...] = ()  # every rank's, sent once, on the next report
    last_command: int = -1  # the id of the last command processed
    timer: StepTimer = dataclasses.field(
        default_factory=lambda: StepTimer(cuda=not current_platform.is_cpu())
    )


class OpsMissingError(RuntimeError):
    """The compiled model lacks the wait/prefetch ops for layers the plugin would offload."""


class DynamicOffloadMixin:
    """Shared by the CUDA and CPU workers (placed before vLLM's worker class in the MRO)."""

    _dynoff: _State

    # -- start-up -----------------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("dynamic offload does not support pipeline parallelism yet")
        if not current_platform.is_cpu():
            check_gpu_config(vllm_config)
        check_features(vllm_config)
        check_kv_connector(vllm_config)
        route = check_compile_config(vllm_config.compilation_config)
        if route == "split":
            # The plugin entry point installs it too, but VLLM_PLUGINS can leave general
            # plugins out; without the hook the ops would never be inserted.
            hacks.run_pass_before_fx_split(LAYER_PREFETCH_PASS)
        logger.info("dynamic offload: compilation route %r", route)
        extra = vllm_config.additional_config
        raw = extra.get(DynamicOffloadConfig.KEY) if isinstance(extra, dict) else None
        config = DynamicOffloadConfig.from_dict(raw)
        if current_platform.is_cpu():
            with hacks.cpu_linear_keeps_weights():
                super().load_model(*args, **kwargs)  # type: ignore[misc]
        else:
            super().load_model(*args, **kwargs)  # type: ignore[misc]
        self._dynoff = self._place_weights(self._resolve_kv_layout(config))

    def _resolve_kv_layout(self, config: DynamicOffloadConfig) -> DynamicOffloadConfig:
        """``config`` with ``kv_layout`` resolved to ``"packed"`` or ``"per_layer"``, as the
        scheduler resolves it from the KV cache config (:func:`resolve_kv_layout`)."""
        on_cpu = current_platform.is_cpu()
        v2 = uses_v2_runner(self.vllm_config)  # type: ignore[attr-defined]
        specs = []
        if v2 and not on_cpu:
            specs = list(self.model_runner.get_kv_cache_spec().values())  # type: ignore[attr-defined]
        layout, why = resolve_kv_layout(config.kv_layout, specs, on_cpu, v2)
        logger.info("dynamic offload: KV layout %r (%s)", layout, why)
        return dataclasses.replace(config, kv_layout=layout)

    def _place_weights(self, config: DynamicOffloadConfig) -> _State:
        layers = find_decoder_layers(self.model_runner.get_model())  # type: ignore[attr-defined]
        if current_platform.is_cpu():
            arena = VmmArena("host", page_size=config.host_page_size)
        else:
            arena = VmmArena(
                "cuda", device=torch.cuda.current_device(), page_size=self._page_size(config)
            )
        probe = sum(p.numel() * p.element_size() for p in layers[0].parameters())
        max_level = self._fit_max_level(config, len(layers), probe)
        cuda = not current_platform.is_cpu()
        torch_before = torch.cuda.memory_allocated() if cuda else 0
        started = time.perf_counter()
        placement = WeightPlacement(arena, layers, max_level, pin_homes=config.pin_homes)
        placed_s = time.perf_counter() - started
        if cuda:
            moved = max(0, torch_before - torch.cuda.memory_allocated())
        else:
            moved = placement.num_layers * placement.layer_bytes
        self._correct_weights_memory(placement, moved)
        planned = planned_layer_bytes(self.vllm_config, config.layer_bytes)  # type: ignore[attr-defined]
        if check_planned_layer(planned, placement.layer_bytes, arena.page_size) > 0:
            logger.warning(
                "dynamic offload: the KV tiers are planned for %.1f MiB layers but a layer "
                'frees %d pages (%.1f MiB); the rest stays unused. Set "layer_bytes": %d.',
                planned / 2**20,
                placement.pages_per_layer,
                placement.layer_bytes / 2**20,
                placement.layer_bytes,
            )
        packs = placement.offloadable()
        engine = PrefetchEngine.for_placement(placement, timing=config.measure_transfers)
        rt = runtime.OffloadRuntime(len(layers), engine)
        runtime.install(rt)
        logger.info(
            "dynamic offload: %d decoder layers of %.1f MiB packed into VMM (%s backend), "
            "max level %d, %d layers' homes on the host, page-locked %s (%.1f s%s)",
            len(layers),
            placement.layer_bytes / 2**20,
            arena.backend,
            max_level,
            len(packs),
            "now" if config.pin_homes == "start" else "as each level is first entered",
            placed_s,
            f"; GPU memory peaked at {placement.peak_bytes / 2**30:.1f} GiB while packing"
            if placement.peak_bytes
            else "",
        )
        return _State(config, arena, placement, engine, rt)

    def _fit_max_level(
        self, config: DynamicOffloadConfig, num_layers: int, layer_bytes: int
    ) -> int:
        """The max level every rank can pin host memory for, agreed before any rank pins
        (the gather is the barrier), and published for the scheduler, which cannot see the
        host memory the workers saw before they pinned it."""
        memory = psutil.virtual_memory()
        world = self.vllm_config.parallel_config.world_size  # type: ignore[attr-defined]
        share = HostShare(
            socket.gethostname(),
            memory.available,
            memory.total,
            layer_bytes,
            kv_tier_host_bytes(self.vllm_config) // world,  # type: ignore[attr-defined]
        )
        shares = self._gather([share])
        max_level = config.policy.fit_max_level(num_layers, shares)
        if (note := config.policy.capped_note(num_layers, shares, max_level)) is not None:
            logger.warning("dynamic offload: %s", note)
        if self.rank == 0:  # type: ignore[attr-defined]
            try:
                publish_max_level(board_dir(self.vllm_config.instance_id), max_level)  # type: ignore[attr-defined]
            except (OSError, ValueError) as e:
                logger.warning("dynamic offload: could not publish the max level: %s", e)
        return max_level

    def _page_size(self, config: DynamicOffloadConfig) -> int:
        """CUDA: the granule for vLLM's per-layer KV tensors; for the packed layout the page
        :func:`choose_page_size` picks, which the scheduler derives the same way."""
        if config.kv_layout != "packed":
            return 0  # the driver's granularity
        planned = planned_layer_bytes(self.vllm_config, config.layer_bytes)  # type: ignore[attr-defined]
        page = choose_page_size(planned, sum(self._per_layer_block_bytes()))
        logger.info(
            "dynamic offload: packed KV layout, weights and KV tiers on %d MiB pages",
            page >> 20,
        )
        return page

    def _correct_weights_memory(self, placement: WeightPlacement, moved: int) -> None:
        """The packed matrices now live in VMM pages, which vLLM's profiler counts as
        non-torch memory; their torch copies are freed. Take the bytes torch freed (measured,
        on CUDA) out of ``model_memory_usage`` so the KV budget does not count them twice."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if not current_platform.is_cpu():
            torch.cuda.empty_cache()
        before, after = hacks.take_out_of_model_memory(runner, moved)
        logger.info(
            "dynamic offload: %.2f GiB of decoder weights moved to VMM (%.2f GiB of pages); "
            "torch-held model memory %.2f -> %.2f GiB",
            moved / 2**30,
            placement.arena.stats().bytes_allocated / 2**30,
            before / 2**30,
            after / 2**30,
        )

    def determine_available_memory(self) -> int:
        base_bytes = super().determine_available_memory()  # type: ignore[misc]
        state = self._dynoff
        strides = self._kv_strides()
        per_block = sum(strides)
        plan = plan_capacity(
            strides,
            base_bytes // per_block,
            self._layer_bytes(),
            state.placement.max_level,
            state.arena.page_size,
            stock_block_bytes=self._per_layer_block_bytes(),  # what stock would allocate
        )
        state.plan = plan
        logger.info(
            "dynamic offload: KV cache sized for level %d: %d blocks (%d mapped at level 0)",
            plan.max_level,
            plan.num_blocks,
            plan.capacity_blocks(0),
        )
        return plan.num_blocks * per_block

    def _per_layer_block_bytes(self) -> tuple[int, ...]:
        specs = self.model_runner.get_kv_cache_spec()  # type: ignore[attr-defined]
        return tuple(spec.page_size_bytes for spec in specs.values())

    def _kv_strides(self) -> tuple[int, ...]:
        """Bytes a block takes in each KV buffer: per layer, or once in the packed buffer."""
        per_layer = self._per_layer_block_bytes()
        return (sum(per_layer),) if self._dynoff.config.kv_layout == "packed" else per_layer

    def _layer_bytes(self) -> int:
        """The layer size the KV tiers are planned with: the scheduler's own figure."""
        return planned_layer_bytes(self.vllm_config, self._dynoff.config.layer_bytes)  # type: ignore[attr-defined]

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        state = self._dynoff
        if state.config.kv_layout == "packed":
            kv_cache_config = packed_kv_cache_config(kv_cache_config)
        plan, state.layout = recover_plan(
            kv_cache_config,
            self._layer_bytes(),
            state.placement.max_level,
            state.arena.page_size,
        )
        state.plan = plan
        state.kv = VmmKVCache(state.arena, kv_cache_config, plan.group_blocks, plan.groups_at(0))
        kv = state.kv
        sync = (lambda: None) if current_platform.is_cpu() else torch.cuda.synchronize
        state.levels = LevelChanger(
            self.rank,  # type: ignore[attr-defined]
            state.placement,
            kv,
            state.engine,
            state.runtime,
            sync,
        )
        state.levels.audit = state.config.audit_changes
        runtime_ = state.runtime

        def piecewise() -> bool:
            return runtime_.needs_piecewise()

        runner = self.model_runner  # type: ignore[attr-defined]
        if uses_v2_runner(self.vllm_config):  # type: ignore[attr-defined]
            with hacks.kv_allocation_v2(lambda _config: kv.tensors()):
                super().initialize_from_config(kv_cache_config)  # type: ignore[misc]
            if runner.cudagraph_manager is not None:  # created by initialize_kv_cache
                hacks.steer_cudagraph_manager(
                    runner.cudagraph_manager, piecewise, runtime_.observe_dispatch
                )
            return
        dispatcher = getattr(runner, "cudagraph_dispatcher", None)
        if dispatcher is not None and not current_platform.is_cpu():
            hacks.steer_cudagraph_dispatch(dispatcher, piecewise, runtime_.observe_dispatch)
        hacks.route_kv_allocation(runner, lambda _config: kv.tensors())
        hacks.keep_kv_allocation_hooked(runner)
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]

    def compile_or_warm_up_model(self) -> Any:
        """vLLM's warm-up, then a clean slate: the V2 runner warms up through the worker's own
        ``execute_model``, and those dummy steps are not the scheduler's."""
        result = super().compile_or_warm_up_model()  # type: ignore[misc]
        state = self._dynoff
        if state.config.home == "device":
            self._move_homes_to_device()
        state.step = -1
        state.outcomes.clear()
        state.timer = StepTimer(cuda=not current_platform.is_cpu())
        state.calibration = self._calibrate()
        self._check_ops_ran()
        state.plans = self._gather_plans()
        return result

    def _gather_plans(self) -> tuple[PlanReport, ...]:
        """Every rank's plan, for the scheduler to check against its own on the first
        report (rank 0's reaches it)."""
        state = self._dynoff
        assert state.plan is not None and state.layout is not None
        mine = plan_report(
            self.rank,  # type: ignore[attr-defined]
            state.plan,
            state.layout,
            state.config.kv_layout,
            state.placement.pages_per_layer,
        )
        return tuple(self._gather([mine]))

    def _move_homes_to_device(self) -> None:
        """The fast-link emulation (:mod:`.homes`): the offloaded layers' homes move from
        pinned host memory into GPU memory beyond vLLM's budget, now that the KV cache and
        the graphs have what the budget gave them; copies are paced to ``home_GBps``."""
        state = self._dynoff
        config, placement, engine = state.config, state.placement, state.engine
        if current_platform.is_cpu():
            raise homes.HomeError('home "device" needs a GPU; use "host" on the CPU engine')
        free, total = torch.cuda.mem_get_info()
        budget = self.vllm_config.cache_config.gpu_memory_utilization  # type: ignore[attr-defined]
        beyond = max(0, min(free, int(total * (1 - budget))) - homes.HOME_MARGIN)
        homes.check_device_home(placement.max_level, placement.layer_bytes, beyond)
        moved = homes.move_homes_to_device(
            engine.sources, torch.cuda.current_device(), placement.offloadable()
        )
        paced = "unpaced"
        if config.home_GBps is not None and engine.sources:
            engine.pacer = homes.Pacer(config.home_GBps)
            engine.pacer.calibrate(next(iter(engine.sources.values())))
            paced = engine.pacer.describe()
        logger.info(
            "dynamic offload: EMULATION of a fast link: %d layers' homes (%.1f GiB) in GPU "
            "memory beyond gpu_memory_utilization=%.2f instead of pinned host memory, copies %s",
            len(engine.sources),
            moved / 2**30,
            budget,
            paced,
        )

    def _check_ops_ran(self) -> None:
        """Refuse k > 0 unless the compiled model really runs the ops: warm-up, capture and
        the calibration ran every op eagerly at least once, so a layer whose wait or prefetch
        never ran has none, and offloading it would run it on its partner's weights."""
        state = self._dynoff
        max_level = state.placement.max_level
        missing = state.runtime.missing_ops(max_level) if max_level > 0 else {}
        if missing:
            raise OpsMissingError(
                "dynamic offload: the compiled model runs no "
                + " and no ".join(
                    f"{op}_layer op for layers {layers}" for op, layers in missing.items()
                )
                + f", which max level {max_level} offloads: they would run on wrong weights. "
                "The layer pass did not transform this graph (a compile cache written "
                "without it, or layers it could not find; see its log line). Remove vLLM's "
                "compile cache (VLLM_CACHE_ROOT, torch_compile_cache) and restart, or set "
                '"policy": {"max_level": 0} to serve without offloading'
            )

    def _calibrate(self) -> Calibration | None:
        """Measure the link, the piecewise penalty and a level change (see
        :mod:`.calibrate`); on failure the policy prices with the configured figures."""
        state = self._dynoff
        assert state.levels is not None and state.plan is not None
        cuda = not current_platform.is_cpu()
        runner = self.model_runner  # type: ignore[attr-defined]
        vllm_config = self.vllm_config  # type: ignore[attr-defined]
        run_decode = None
        if cuda and vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs():
            run_decode = lambda batch: hacks.dummy_decode(runner, batch)  # noqa: E731
        max_batch = min(
            vllm_config.scheduler_config.max_num_seqs,
            vllm_config.compilation_config.max_cudagraph_capture_size or 1,
        )
        started = time.perf_counter()
        try:
            result = calibrate.calibrate(state.levels, state.plan, run_decode, max_batch, cuda)
        except calibrate.CalibrationLeftLevel:  # also a torn change: calibrate converts it
            raise  # this rank is not at level 0: serving would be wrong, so do not start
        except Exception as exc:  # serving goes on, priced with the configured figures
            logger.warning(
                "dynamic offload: calibration failed (%s); using the configured "
                "h2d_GBps and piecewise_penalty_ms",
                exc,
            )
            return None
        logger.info(
            "dynamic offload: calibrated in %.1f s: %s",
            time.perf_counter() - started,
            calibrate.describe(result),
        )
        return result

    # -- per step -----------------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any) -> Any:
        state = self._dynoff
        command = getattr(scheduler_output, SCHEDULER_OUTPUT_ATTR, None)
        if command is not None:
            assert state.levels is not None
            state.outcomes += state.levels.apply_everywhere(command, self._gather)
            state.last_command = command.command_id
        state.step += 1
        decode, prefill, context = StepShape.of(scheduler_output)
        pairs = prefill_pairs(scheduler_output) if prefill else 0
        state.timer.start(
            Timed(state.step, state.placement.level, decode, prefill, context, prefill_pairs=pairs)
        )
        output = super().execute_model(scheduler_output)  # type: ignore[misc]
        return self._attach(output)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        return self._attach(super().sample_tokens(*args, **kwargs))  # type: ignore[misc]

    def _attach(self, output: Any) -> Any:
        """Attach this step's report (rank 0's output reaches the scheduler)."""
        if output is None:
            return None
        state = self._dynoff
        state.timer.stop()
        timed = state.timer.latest_finished()
        outcomes, state.outcomes = state.outcomes, []
        if timed is None:  # nothing finished yet: report the resize outcomes only
            timed = Timed(state.step, state.placement.level, 0, 0)
        report = StepReport(
            timed.step,
            timed.level,
            timed.forward_ms,
            timed.decode_tokens,
            timed.prefill_tokens,
            tuple(outcomes),
            state.calibration,
            state.engine.restore_wait_ms() if state.engine.on_cuda else 0.0,
            state.plans,
            state.last_command,
            state.placement.level,
            timed.context_tokens,
            self._link_GBps(),
            timed.prefill_pairs,
        )
        state.calibration = None
        state.plans = ()
        if isinstance(output, AsyncModelRunnerOutput):
            hacks.chain_async_output(output, lambda inner: with_report(inner, report))
            return output
        return with_report(output, report)

    def _link_GBps(self) -> float | None:
        """The emulated link's bandwidth while serving, every ``LINK_REPORT_STEPS`` steps
        (a paced device home only)."""
        pacer = self._dynoff.engine.pacer
        if pacer is None or self._dynoff.step % LINK_REPORT_STEPS:
            return None
        return pacer.achieved_GBps

    # -- benchmarks (``LLM.collective_rpc``) -----------------------------------------------------
    def dynoff_stats(self, reset: bool = True) -> dict[str, Any]:
        """This rank's level, layer and KV geometry, and prefetch transfers since the last
        call (timed when ``measure_transfers`` is on)."""
        state = self._dynoff
        return {
            "rank": self.rank,  # type: ignore[attr-defined]
            "level": state.placement.level,
            "max_level": state.placement.max_level,
            "num_layers": state.placement.num_layers,
            "layer_bytes": state.placement.layer_bytes,
            "pages_per_layer": state.placement.pages_per_layer,
            "kv_block_bytes": sum(self._kv_strides()),
            "transfers": state.engine.transfer_stats(reset),
        }

    def dynoff_kv_outside_vmm(self) -> list[str]:
        """HACK guard, in the real engine: the attention layers whose bound KV cache (what
        the forward reads, vLLM's forward context) does not lie inside this rank's VMM KV
        ranges. Empty when the KV allocation hook took effect (``hacks.route_kv_allocation``
        / ``hacks.kv_allocation_v2``)."""
        kv = self._dynoff.kv
        assert kv is not None
        spans = [(b.range.ptr, b.range.ptr + b.range.nbytes) for b in kv.buffers]
        context = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        outside = []
        for name, layer in context.items():
            caches = getattr(layer, "kv_cache", None)
            if caches is None:
                continue
            for cache in caches if isinstance(caches, list | tuple) else [caches]:
                if cache.numel() == 0:  # a placeholder, never read
                    continue
                start, end = cache.data_ptr(), cache.data_ptr() + cache.nbytes
                if not any(lo <= start and end <= hi for lo, hi in spans):
                    outside.append(name)
        return outside

    def dynoff_dispatches(self) -> dict[str, int]:
        """HACK guard, in the real engine: graph dispatches while the ops had to run, and how
        many of them still went to a FULL graph (which would skip the ops: must be 0)."""
        return dict(self._dynoff.runtime.dispatches)

    def dynoff_force_piecewise(self, on: bool) -> None:
        """Benchmarks: run the piecewise graphs at k = 0 too (the path every k > 0 takes)."""
        self._dynoff.runtime.force_piecewise = on

    def dynoff_link_peak(self, repeats: int = 5) -> float:
        """Host-to-device GB/s of one layer-sized copy from pinned memory into a scratch
        buffer, best of ``repeats``: the link's peak, measured in this process."""
        sources = self._dynoff.engine.sources
        if not sources or current_platform.is_cpu():
            return 0.0
        src = next(iter(sources.values()))
        dst = torch.empty_like(src, device=torch.cuda.current_device())
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        del dst
        return src.numel() / best / 1e9

    def _gather(self, items: list[T]) -> list[T]:
        """Every rank's items (resize outcomes, plans), on every rank: rank 0's report
        carries them."""
        world = self.vllm_config.parallel_config.world_size  # type: ignore[attr-defined]
        if world == 1:
            return items
        from vllm.distributed.parallel_state import get_world_group

        return gather_all(items, world, get_world_group().cpu_group)
