"""The cache stage: a second process compiling the same program starts warm.

Around the whole compilation of a Dynamo graph, the stage computes a
``loom_cache`` key (graph fingerprint, environment, loom's versions and
options, the active saved-tensor hooks) and looks it up. On a hit it serves
AOTAutograd's result from the stored artifact, so AOT tracing, hook placement,
partitioning and codegen are all skipped, and it replays the report entries
the cold compilation made (hook placement, plans). On a miss it compiles cold,
captures the bundled result and stores it. A cache problem of any kind is a
miss with a logged reason; it never fails a compilation.

A stage whose decisions depend on more than the options, or must be redone on a
hit (the CUDA-graph stage: its op registry, its plans' skip messages), takes
part as a :class:`CachedStage`: its settings enter the key, its payload (plain
data) is stored with the artifact, and a hit hands the payload back to it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import torch
from torch.fx import GraphModule

import loom_cache
from torchloom import _torch_compat as compat
from torchloom._stages import Codegen, GraphContext, GraphKind, PipelineStage

__all__ = ["CacheStage", "CachedStage", "cache_store"]

log = logging.getLogger("torchloom.cache")

ARTIFACT_FORMAT: Final = 2
_LOOM_DISTRIBUTIONS: Final = (
    "torchloom",
    "torchloom-cache",
    "torchloom-hops",
    "torchloom-resize",
    "torchloom-cudagraph",
    "torchloom-sidefx",
    "torchloom-cells",
)
_LOOM_MODULES: Final = (
    "torchloom",
    "loom_cache",
    "loom_hops",
    "loom_resize",
    "loom_cudagraph",
    "loom_sidefx",
    "loom_cells",
)
_FRAME = re.compile(r'File "([^"]+)", line \d+, in (\S+)')

_store_lock = threading.Lock()
_stores: dict[tuple[str, str], loom_cache.TieredStore] = {}


def cache_store() -> loom_cache.TieredStore:
    """The process's store for the current ``TORCHLOOM_CACHE_DIR`` / ``TORCHLOOM_REMOTE_CACHE``."""
    ident = (str(loom_cache.default_cache_dir()), os.environ.get("TORCHLOOM_REMOTE_CACHE", ""))
    with _store_lock:
        if ident not in _stores:
            _stores[ident] = loom_cache.open_default_store()
        return _stores[ident]


@runtime_checkable
class CachedStage(Protocol):
    """A pipeline stage whose work a cache hit must key on and redo.

    ``cache_settings`` returns what decides the stage's result beyond the
    options (JSON-able, it becomes the key component named after the stage), or
    ``None`` when the stage does nothing for this graph. ``cache_payload``
    returns plain, picklable data stored with the artifact (``None``: nothing).
    On a hit, ``replay_cached`` gets that payload back and re-makes the stage's
    report entries and messages; the stored entries of the stage's area are
    not replayed for it.
    """

    name: str

    def cache_settings(self, ctx: GraphContext) -> Mapping[str, Any] | None: ...

    def cache_payload(self, ctx: GraphContext) -> Any: ...

    def replay_cached(self, ctx: GraphContext, payload: Any) -> None: ...


def _cached_stages() -> list[CachedStage]:
    from torchloom._stages import STAGES

    return [s for s in STAGES if isinstance(s, CachedStage)]


@dataclasses.dataclass(frozen=True, slots=True)
class Artifact:
    """What a hit needs: AOTAutograd's bundled result, the report the cold
    compilation made (entries and graphs of the other stages) and the payloads
    of the :class:`CachedStage` stages, by stage name."""

    format: int
    aot_result: bytes
    entries: tuple[tuple[str, str, str, tuple[tuple[str, Any], ...]], ...]
    graphs: tuple[tuple[str, str], ...]
    stages: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass
class Compilation:
    """One keyed compilation in progress (``ctx.state["cache"]``): where its result
    goes, and which report entries and graphs it made (those after ``first_*``).

    ``awaiting_backward``: the compilation returned before AOTAutograd saved its
    entry, because the backward compiles at its first call (``grad_hook`` sites);
    the entry is stored right after that compile.
    """

    key: loom_cache.CacheKey
    store: loom_cache.TieredStore
    slot: compat.AotCacheSlot
    first_entry: int
    first_graph: int
    compiled: set[GraphKind] = dataclasses.field(default_factory=set)
    awaiting_backward: bool = False


def _versions() -> str:
    """Versions of loom's distributions and the identity of every pipeline stage:
    a pipeline with another set of stages never shares an entry."""
    from torchloom._stages import STAGES

    parts = [f"stage={type(s).__module__}.{type(s).__qualname__}" for s in STAGES]
    for dist in _LOOM_DISTRIBUTIONS:
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    parts.append(f"source={loom_source_hash()}")
    return ";".join(parts)


@functools.cache
def loom_source_hash() -> str:
    """A hash of the source files of every loom package, read once per process.

    Versions alone do not change while loom is developed (an editable install
    keeps 0.1.0 across edits); the source does, so an edited pass never meets
    an artifact its old code made (Inductor keys on torch's source the same way).
    """
    digest = hashlib.sha256()
    for name in _LOOM_MODULES:
        spec = importlib.util.find_spec(name)
        roots = list(spec.submodule_search_locations or ()) if spec is not None else []
        for root in roots:
            for folder, dirs, files in os.walk(root):
                dirs.sort()
                for fname in sorted(files):
                    if fname.endswith(".py"):
                        path = os.path.join(folder, fname)
                        digest.update(os.path.relpath(path, root).encode())
                        with open(path, "rb") as f:
                            digest.update(f.read())
    return digest.hexdigest()[:16]


def _program(gm: GraphModule) -> str:
    """``file:function`` of the user code the graph came from (explanations only)."""
    for node in gm.graph.nodes:
        match = _FRAME.findall(node.meta.get("stack_trace") or "")
        if match:
            path, fn = match[-1]
            return f"{os.path.basename(path)}:{fn}"
    return "graph"


def _device(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _picklable(data: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    out = []
    for k, v in data:
        try:
            pickle.dumps(v)
        except Exception:
            v = repr(v)
        out.append((k, v))
    return tuple(out)


class CacheStage(PipelineStage):
    """Looks up and stores whole compilations in ``loom_cache``."""

    name = "cache"

    def _bypass(self, ctx: GraphContext, bypass: loom_cache.CacheBypass) -> None:
        ctx.state[self.name] = bypass
        ctx.record.add_entry(
            "cache", "bypass", str(bypass), kind_=bypass.kind.value, where=bypass.where
        )
        if bypass.kind is not loom_cache.CacheBypassKind.DISABLED:
            log.info("graph %d: %s", ctx.graph_id, bypass)

    def _key(self, ctx: GraphContext) -> loom_cache.CacheKey | loom_cache.CacheBypass:
        if not ctx.options.cache:  # TORCHLOOM_CACHE is resolved into the options, once
            return loom_cache.CacheBypass(
                loom_cache.CacheBypassKind.DISABLED, "options", "the loom cache is off"
            )
        if compat.caches_force_disabled():
            return loom_cache.CacheBypass(
                loom_cache.CacheBypassKind.DISABLED,
                "torch.compiler.config.force_disable_caches",
                "PyTorch's caches are force-disabled",
            )
        hooks = ctx.state.get("hooks")
        pair = getattr(hooks, "pair", None)
        hooks_fp = getattr(hooks, "fingerprint", None)
        if pair is not None and hooks_fp is None:
            return loom_cache.CacheBypass(
                loom_cache.CacheBypassKind.UNHASHABLE_CLOSURE,
                "active saved_tensors_hooks",
                "the hooks have no process-stable fingerprint",
                "capture plain values in the hooks, or give captured objects a `cache_hash`",
            )
        fp = loom_cache.graph_fingerprint(ctx.dynamo_gm)
        if fp.bypass is not None:
            return fp.bypass
        options = {k: v for k, v in ctx.options.as_dict().items() if k != "cache"}
        hooks_component = loom_cache.KeyComponent(
            "hooks",
            loom_cache.stable_digest(hooks_fp or "none"),
            "none" if pair is None else f"saved_tensors_hooks {hooks_fp}",
        )
        return loom_cache.make_key(
            _program(ctx.dynamo_gm),
            fp,
            device=_device(ctx.example_inputs),
            backend=("loom", _versions()),
            options=options,
            extra=[hooks_component, *_stage_components(ctx)],
        )

    def wrap_backend(
        self,
        ctx: GraphContext,
        example_inputs: Sequence[Any],
        compile_cold: Callable[[], Callable[..., Any]],
    ) -> Callable[..., Any]:
        try:
            key = self._key(ctx)
        except compat.CONTROL_FLOW_EXCEPTIONS:
            raise
        except Exception as err:  # the cache never fails a compile
            log.warning(
                "graph %d: loom cache key failed, compiling without it: %r", ctx.graph_id, err
            )
            key = loom_cache.CacheBypass(
                loom_cache.CacheBypassKind.UNHASHABLE_CONSTANT,
                "key",
                f"{type(err).__name__}: {err}",
            )
        if isinstance(key, loom_cache.CacheBypass):
            self._bypass(ctx, key)
            return compile_cold()
        store = cache_store()
        artifact, reason = self._load(store, key)
        slot = compat.AotCacheSlot(key=f"loom-{key.digest}")
        if artifact is not None:
            slot.load = artifact.aot_result
        record = ctx.record.build()
        run = Compilation(key, store, slot, len(record.entries), len(record.graphs))
        ctx.state[self.name] = run
        with compat.aot_cache_slot(slot):
            compiled = compile_cold()
        if slot.loaded and artifact is not None:
            self._replay(ctx, artifact)
            store.local.record(hit=True)
            ctx.record.add_entry(
                "cache",
                "hit",
                f"loom cache hit {key.digest[:16]} ({key.program})",
                digest=key.digest,
            )
            return compiled
        if slot.load_error is not None:
            reason = f"stored artifact could not be served: {slot.load_error}"
            log.warning("graph %d: %s", ctx.graph_id, reason)
        self._miss(ctx, store, key, reason)
        lazy = run.compiled == {GraphKind.FORWARD} and not slot.save_attempted
        if not lazy:
            self._save(ctx, run)
        else:
            run.awaiting_backward = True
            ctx.record.add_entry(
                "cache",
                "pending",
                "the backward compiles at its first call: the entry is stored after it",
                digest=key.digest,
            )
        return compiled

    def wrap_compiled(
        self,
        ctx: GraphContext,
        fn: Callable[..., Any],
        gm: GraphModule,
        kind: GraphKind,
        example_inputs: Sequence[Any],
    ) -> Callable[..., Any]:
        run = ctx.state.get(self.name)
        if not isinstance(run, Compilation):
            return fn
        run.compiled.add(kind)
        if kind is not GraphKind.BACKWARD or not run.awaiting_backward:
            return fn
        # NOTE: a lazily compiled backward: AOTAutograd makes and saves the complete entry
        # right after this compiler returns, outside our compilation's slot routing.
        run.awaiting_backward = False
        compat.route_lazy_backward_save(run.slot, lambda: self._save_late(ctx, run))
        return fn

    def _save_late(self, ctx: GraphContext, run: Compilation) -> None:
        try:
            self._save(ctx, run)
        except Exception as err:  # inside the user's backward: the cache never fails it
            log.warning("graph %d: could not store the compiled artifact: %r", ctx.graph_id, err)

    def compile(
        self,
        ctx: GraphContext,
        gm: GraphModule,
        kind: GraphKind,
        example_inputs: Sequence[Any],
        static_input_idxs: Sequence[int],
        codegen: Codegen,
    ) -> Callable[..., Any] | None:
        # Eager codegen as a serializable OutputCode, so eager compilations cache too,
        # unless a later stage takes over compilation itself.
        if (
            ctx.options.codegen == "eager"
            and isinstance(ctx.state.get(self.name), Compilation)
            and not _later_stage_compiles(self)
        ):
            return compat.EagerOutputCode(gm)
        return None

    def _load(
        self, store: loom_cache.TieredStore, key: loom_cache.CacheKey
    ) -> tuple[Artifact | None, str]:
        try:
            found = store.lookup(key.digest)
        except Exception as err:
            return None, f"lookup failed: {type(err).__name__}: {err}"
        if found.entry is None:
            return None, found.reason
        try:
            artifact = pickle.loads(found.entry.payload)
            if not isinstance(artifact, Artifact) or artifact.format != ARTIFACT_FORMAT:
                raise TypeError("not a loom artifact of this format")
        except Exception as err:
            store.delete(key.digest)
            return None, f"unreadable artifact: {type(err).__name__}: {err}"
        return artifact, "hit"

    def _miss(
        self,
        ctx: GraphContext,
        store: loom_cache.TieredStore,
        key: loom_cache.CacheKey,
        reason: str,
    ) -> None:
        explanation = ""
        try:
            store.local.record(hit=False)
            store.local.record_miss(key)
            nearest = loom_cache.nearest_key(
                key, (i.key for i in store.local.entries() if i.key.program == key.program)
            )
            if nearest is not None:
                diffs = loom_cache.explain_miss(key, nearest)
                explanation = "; ".join(str(d) for d in diffs)
        except Exception as err:
            explanation = f"(no explanation: {err})"
        message = f"loom cache miss {key.digest[:16]} ({key.program}): {reason}"
        if explanation:
            message += f"; differs from the nearest entry in {explanation}"
        ctx.record.add_entry("cache", "miss", message, digest=key.digest)
        log.info("graph %d: %s", ctx.graph_id, message)

    def _save(self, ctx: GraphContext, run: Compilation) -> None:
        store, key, slot = run.store, run.key, run.slot
        first_entry, first_graph = run.first_entry, run.first_graph
        record = ctx.record.build()
        hooks = ctx.state.get("hooks")
        if record.fallback is not None or not getattr(hooks, "cacheable", True):
            ctx.record.add_entry(
                "cache",
                "not-stored",
                "the compilation fell back or left the hooks eager; nothing stored",
            )
            return
        if slot.saved is None:
            self._bypass(
                ctx,
                loom_cache.CacheBypass(
                    loom_cache.CacheBypassKind.UNSERIALIZABLE_ARTIFACT,
                    "AOTAutograd result",
                    slot.save_error or "AOTAutograd produced no cacheable result",
                ),
            )
            return
        try:
            payloads = ((s.name, s.cache_payload(ctx)) for s in _cached_stages())
            stages = tuple((name, p) for name, p in payloads if p is not None)
            owned = {"cache", *(name for name, _ in stages)}
            entries = tuple(
                (e.area, e.kind, e.message, _picklable(e.data))
                for e in record.entries[first_entry:]
                if e.area not in owned
            )
            graphs = record.graphs[first_graph:]
            artifact = Artifact(ARTIFACT_FORMAT, slot.saved, entries, graphs, stages)
            payload = pickle.dumps(artifact)
            store.put(loom_cache.Entry(key, payload, (("loom", _versions()),)))
        except Exception as err:
            log.warning("graph %d: could not store the compiled artifact: %r", ctx.graph_id, err)
            ctx.record.add_entry("cache", "not-stored", f"store failed: {err}")
            return
        ctx.record.add_entry(
            "cache", "stored", f"stored {key.digest[:16]} ({len(payload)} bytes)", digest=key.digest
        )

    def _replay(self, ctx: GraphContext, artifact: Artifact) -> None:
        for area, kind, message, data in artifact.entries:
            ctx.record.add_entry(area, kind, message, **dict(data))
        for kind, code in artifact.graphs:
            ctx.record.add_graph(kind, code)
        payloads = dict(artifact.stages)
        for stage in _cached_stages():
            if stage.name in payloads:
                stage.replay_cached(ctx, payloads[stage.name])


def _stage_components(ctx: GraphContext) -> list[loom_cache.KeyComponent]:
    """One key component per :class:`CachedStage` with settings for this graph."""
    components = []
    for stage in _cached_stages():
        settings = stage.cache_settings(ctx)
        if settings is not None:
            items = dict(sorted(settings.items()))
            components.append(
                loom_cache.KeyComponent(
                    stage.name,
                    loom_cache.stable_digest(items),
                    json.dumps(items, sort_keys=True, default=str),
                )
            )
    return components


def _later_stage_compiles(stage: PipelineStage) -> bool:
    from torchloom._stages import STAGES

    later = STAGES[STAGES.index(stage) + 1 :] if stage in STAGES else []
    return any(type(s).compile is not PipelineStage.compile for s in later)
