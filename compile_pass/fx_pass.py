"""``LayerPrefetchPass``: insert the wait and prefetch ops at decoder-layer boundaries.

Contract. The pass runs on one whole graph: the post-grad graph when vLLM uses Inductor graph
partition (route ``partition``, registered as ``post_grad_custom_post_pass``), or Dynamo's
graph right before vLLM's FX split (route ``split``, :func:`.hacks.run_pass_before_fx_split`).

* Layer L's nodes are the ``call_function`` / ``call_method`` nodes whose
  ``meta["nn_module_stack"]`` names ``...layers.L...`` (the innermost such index wins).
  The pass needs layers 0..N-1, all present; otherwise it leaves the graph alone and logs
  why.
* Before layer L's first node it inserts ``dynoff.wait_layer(x, L)``, where ``x`` is that
  node's first tensor input produced outside layer L (the residual stream entering L).
* After layer L's last *weight use* (the last non-view node reading a placeholder that only
  layer L reads, directly or through views) it inserts
  ``dynoff.prefetch_layer(y, partner(L))``, ``y`` being that node's output: the copy of the
  partner starts as soon as L no longer needs the shared region.
  The odd-N last layer has no partner and gets no prefetch.

Before / after (one layer, schematically)::

    %norm = auto_functionalized(fused_add_rms_norm, input=%h, ...)   # layers.3
    %qkv  = mm(%x, %w_qkv)                                            # layers.3
    ...
    %down = mm(%act, %w_down)                                         # layers.3

    wait_layer(%h, 3)                           <- inserted: mutates %h, so every reader
    %norm = auto_functionalized(fused_add_rms_norm, input=%h, ...)      of %h follows it
    ...
    %down = mm(%act, %w_down)
    prefetch_layer(%down, 3 + N/2)              <- inserted: readers of %down follow it

Route ``split`` passes vLLM's own split points (``split_points``: its attention and KV-cache
update ops). The ops then move to those points, so every piece vLLM compiles is exactly one
of stock vLLM's pieces, with the same inputs and outputs: Inductor fuses and tunes them as
in stock vLLM, and a step at k = 0 computes the same bits. ``wait_layer(L)`` goes right
after the last split point before layer L (the attention of layer L-1), or to the top of
the graph when none precedes it (layer 0); ``prefetch_layer(P)`` goes right before the
first split point after the last weight use (the next layer's KV-cache update), or to the
end of the graph. Their tensor arguments are taken from what already crosses that point.
A wait moves earlier and a prefetch later, so the region is never overwritten before its
occupant's last use; the pass checks that the second layer of each pair is still copied in
before the step waits for it (and otherwise keeps the boundaries, with a warning).

Invariants kept (Inductor's fx_passes rules): ``meta["val"]`` of existing nodes is untouched
and new nodes return nothing; no new aliasing between inputs and outputs; the only
mutations are the ones the ops' schemas declare, on intermediate values, never on graph
inputs. The pass is idempotent: a graph that already holds the ops is left as it is.
``uuid()`` hashes the source of everything that shapes the output (this module, the pairing,
the ops, the split hook) and the pass's settings, so the compile caches are invalidated
whenever any of them changes.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx
from vllm.compilation.passes.inductor_pass import InductorPass

from dynoff.compile_pass.ops import PREFETCH, WAIT
from dynoff.compile_pass.pairing import partner

logger = logging.getLogger("vllm.dynoff.compile_pass")


class LayerPrefetchPass(InductorPass):
    """Post-grad pass inserting ``wait_layer`` / ``prefetch_layer`` around each layer."""

    def __init__(self, layer_pattern: str = r"(?:^|\.)layers\.(\d+)(?:\.|$)") -> None:
        self.layer_pattern = layer_pattern
        self._regex = re.compile(layer_pattern)
        self.invocations = 0

    def uuid(self) -> str:
        """Everything that shapes the pass's output: this module (the pass and its helpers),
        the pairing, the ops and the hook that runs the pass before vLLM's split, plus the
        settings; Inductor's and vLLM's compile caches key on it."""
        return InductorPass.hash_source(*pass_sources()) + InductorPass.hash_dict(
            {"layer_pattern": self.layer_pattern, "version": 4}
        )

    def __call__(self, graph: fx.Graph, split_points: Collection[str] = ()) -> None:
        """Insert the ops; ``split_points``: the other ops vLLM splits the graph at (route
        ``split``), which the ops then move to (see the module docstring)."""
        self.invocations += 1
        if any(node.target in (WAIT, PREFETCH) for node in graph.nodes):
            return  # already transformed
        by_layer = self._nodes_by_layer(graph)
        if not by_layer:
            logger.debug("no decoder layers found in this graph; nothing to insert")
            return
        num_layers = max(by_layer) + 1
        if sorted(by_layer) != list(range(num_layers)):
            logger.warning(
                "dynamic offload: layers %s missing from the graph; ops not inserted",
                sorted(set(range(num_layers)) - set(by_layer)),
            )
            return
        owned = self._weights_by_layer(graph, by_layer)
        waits = {layer: self._wait_site(layer, by_layer[layer]) for layer in by_layer}
        issuer = {
            other: layer
            for layer in range(num_layers)
            if (other := partner(layer, num_layers)) is not None
        }
        prefetches = {
            other: self._prefetch_site(by_layer[layer], owned[layer])
            for other, layer in issuer.items()
        }
        aligned = False
        if split_points:
            order = {node: n for n, node in enumerate(graph.nodes)}
            points = list(split_points)
            splits = [node for node in graph.nodes if _splits(node, points)]
            moved_waits = {k: _after_split(site, splits, order) for k, site in waits.items()}
            moved = {k: _before_split(site, splits, order, graph) for k, site in prefetches.items()}
            # A layer copied in by an earlier layer of the same step (the second of a pair)
            # must still be issued before the step waits for it. (The first of a pair is
            # copied in at the end of the step before.)
            if all(
                _position(moved[k], order) < _position(moved_waits[k], order)
                for k, layer in issuer.items()
                if k > layer
            ):
                waits, prefetches, aligned = moved_waits, moved, True
            else:
                logger.warning(
                    "dynamic offload: a prefetch would follow its wait at vLLM's split points "
                    "(%d layers); the ops stay at the layer boundaries",
                    num_layers,
                )
        for layer, (where, before, x) in waits.items():
            _insert(graph, WAIT, where, before, x, layer)
        for other, (where, before, y) in prefetches.items():
            _insert(graph, PREFETCH, where, before, y, other)
        graph.lint()
        logger.info(
            "dynamic offload: inserted %d wait_layer and %d prefetch_layer ops (%d layers%s)",
            len(waits),
            len(prefetches),
            num_layers,
            ", at vLLM's split points" if aligned else "",
        )

    # -- analysis -----------------------------------------------------------------------------
    def layer_of(self, node: fx.Node) -> int | None:
        """The innermost ``layers.<i>`` in the node's module provenance."""
        stack = node.meta.get("nn_module_stack") or {}
        found = None
        for entry in stack.values():
            path = entry[0] if isinstance(entry, tuple) else str(entry)
            for match in self._regex.finditer(_normalize(path)):
                found = int(match.group(1))
        return found

    def _nodes_by_layer(self, graph: fx.Graph) -> dict[int, list[fx.Node]]:
        by_layer: dict[int, list[fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op in ("call_function", "call_method"):
                layer = self.layer_of(node)
                if layer is not None:
                    by_layer[layer].append(node)
        return dict(by_layer)

    @staticmethod
    def _weights_by_layer(
        graph: fx.Graph, by_layer: dict[int, list[fx.Node]]
    ) -> dict[int, set[fx.Node]]:
        """Placeholders read by exactly one layer: that layer's weights."""
        layer_of = {node: layer for layer, nodes in by_layer.items() for node in nodes}
        owned: dict[int, set[fx.Node]] = defaultdict(set)
        for node in graph.find_nodes(op="placeholder"):
            readers = {layer_of.get(user) for user in node.users}
            if len(readers) == 1 and None not in readers:
                (layer,) = readers
                assert layer is not None
                owned[layer].add(node)
        return owned

    # -- where the ops go: (node, insert before it?, tensor argument) -----------------------
    @staticmethod
    def _wait_site(layer: int, nodes: list[fx.Node]) -> Site:
        """Before the layer's first node, on the residual stream entering it."""
        inside = set(nodes)
        first = nodes[0]
        x = next(
            (
                a
                for a in first.all_input_nodes
                if a not in inside and _is_tensor(a) and a.op != "placeholder"
            ),
            None,
        )
        if x is None:
            x = next((a for a in first.all_input_nodes if _is_tensor(a)), None)
        if x is None:
            raise RuntimeError(f"layer {layer}: no tensor input to order the wait on")
        return first, True, x

    @staticmethod
    def _prefetch_site(nodes: list[fx.Node], weights: set[fx.Node]) -> Site:
        """Right after the layer's last weight use, on that node's output."""
        # Views of a weight (permute, reshape, ...) read nothing: follow them to the kernels
        # that do, or the copy could overwrite the region before its last reader runs.
        derived = set(weights)
        for node in nodes:
            if _is_view(node) and derived & set(node.all_input_nodes):
                derived.add(node)
        users = [n for n in nodes if n not in derived and derived & set(n.all_input_nodes)] or nodes
        last = users[-1]
        anchor = last if _is_tensor(last) else next((u for u in last.users if _is_tensor(u)), None)
        if anchor is None:
            anchor = next(n for n in reversed(nodes) if _is_tensor(n))
        return anchor, False, anchor


Site = tuple[fx.Node, bool, fx.Node]
"""Where an op goes: (node, insert before it rather than after, the op's tensor argument)."""


def _insert(
    graph: fx.Graph, op: Callable[..., Any], where: fx.Node, before: bool, x: fx.Node, layer: int
) -> None:
    with graph.inserting_before(where) if before else graph.inserting_after(where):
        graph.call_function(op, (x, layer))


def _splits(node: fx.Node, split_points: list[str]) -> bool:
    """Whether vLLM's FX split cuts the graph at ``node`` (vLLM's own rule)."""
    from vllm.compilation.partition_rules import should_split

    return node.target not in (WAIT, PREFETCH) and should_split(node, split_points)


def _position(site: Site, order: dict[fx.Node, int]) -> float:
    node, before, _ = site
    return order[node] - 0.5 if before else order[node] + 0.5


def _after_split(site: Site, splits: list[fx.Node], order: dict[fx.Node, int]) -> Site:
    """Move a wait up to right after the last split point before it, or to the top."""
    position = _position(site, order)
    earlier = [s for s in splits if order[s] < position]
    if earlier:
        split = earlier[-1]
        return split, False, _tensor_input(split) or site[2]
    first = next(n for n in order if n.op != "placeholder")
    x = next((n for n in order if n.op == "placeholder" and _is_tensor(n)), None)
    return (first, True, x) if x is not None else site


def _before_split(
    site: Site, splits: list[fx.Node], order: dict[fx.Node, int], graph: fx.Graph
) -> Site:
    """Move a prefetch down to right before the next split point, or to the end."""
    position = _position(site, order)
    later = [s for s in splits if order[s] > position]
    if later:
        split = later[0]
        return split, True, _tensor_input(split) or site[2]
    output = graph.output_node()
    y = next((a for a in output.all_input_nodes if _is_tensor(a)), site[2])
    return output, True, y


def _tensor_input(node: fx.Node) -> fx.Node | None:
    """A tensor the split point reads: it crosses that point already, so the op taking it
    changes no compiled piece's inputs or outputs."""
    return next((a for a in node.all_input_nodes if _is_tensor(a)), None)


# Views at the Dynamo level (route ``split``): tensor methods and torch functions.
_VIEW_METHODS = frozenset(
    {"view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "chunk"}
)
_VIEW_FUNCTIONS = frozenset({torch.t, torch.transpose, torch.reshape, torch.permute, torch.chunk})


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function":
        return False
    return bool(getattr(node.target, "is_view", False)) or node.target in _VIEW_FUNCTIONS


def _is_tensor(node: fx.Node) -> bool:
    """Post-grad graphs keep the fake value in ``val``, Dynamo's in ``example_value``."""
    value = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(value, torch.Tensor)


def _normalize(path: str) -> str:
    """``L['self'].layers[3].mlp`` / ``model.layers.3.mlp`` -> ``...layers.3.mlp``."""
    return re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path)


def pass_sources() -> list[str]:
    """The source text :meth:`LayerPrefetchPass.uuid` hashes."""
    from dynoff.compile_pass import hacks, ops, pairing

    modules = [sys.modules[__name__], pairing, ops]
    return [inspect.getsource(m) for m in modules] + [
        inspect.getsource(hacks.run_pass_before_fx_split)
    ]


class SplitRouteMarker(InductorPass):
    """Route ``split``: the layer pass already ran on Dynamo's graph, so this post-grad pass
    does nothing; it is registered only so its ``uuid()`` (the layer pass's) enters vLLM's
    compile-cache key, and a changed pass never reuses pieces compiled by an older one."""

    def __init__(self, layer_pass: LayerPrefetchPass) -> None:
        self.layer_pass = layer_pass

    def uuid(self) -> str:
        return self.layer_pass.uuid()

    def __call__(self, graph: fx.Graph) -> None:
        del graph


LAYER_PREFETCH_PASS = LayerPrefetchPass()
SPLIT_ROUTE_MARKER = SplitRouteMarker(LAYER_PREFETCH_PASS)
