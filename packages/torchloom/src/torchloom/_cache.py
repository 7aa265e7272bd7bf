"""The cache steps: a second process compiling the same program starts warm.

While preparing, :func:`cache_key` computes a ``loom_cache`` key (graph
fingerprint, environment, loom's versions and options, the active saved-tensor
hooks, the CUDA-graph settings) or a bypass reason. :func:`look_up` finds the
stored :class:`Artifact`; the pipeline serves AOTAutograd's result from it
(AOT tracing, hook placement, partitioning and codegen all skipped) and
:func:`replay_artifact` re-makes the report entries the cold compilation made.
Otherwise the pipeline compiles cold and :func:`store_compilation` stores the
bundled result. A cache problem of any kind is a miss with a logged reason; it
never fails a compilation.
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
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final

import torch
from torch.fx import GraphModule

import loom_cache
from loom_sidefx import user_frame
from torchloom import _torch_compat as compat
from torchloom._aot_cache import AotCacheSlot, route_lazy_backward_save
from torchloom._distributions import LOOM_DISTRIBUTIONS
from torchloom._hooks import HooksPlan
from torchloom._report import GraphRecordBuilder
from torchloom._values import GraphKind, Snapshot

__all__ = [
    "Artifact",
    "CacheLookup",
    "CacheRun",
    "StoreAfterBackward",
    "cache_key",
    "cache_store",
    "finish_cold",
    "look_up",
    "record_hit",
    "record_miss",
    "replay_artifact",
    "store_compilation",
]

log = logging.getLogger("torchloom.cache")

ARTIFACT_FORMAT: Final = 3
_LOOM_MODULES: Final = (
    "torchloom",
    "loom_cache",
    "loom_hops",
    "loom_resize",
    "loom_cudagraph",
    "loom_sidefx",
    "loom_cells",
)

#: Options that change whether the cache is used, not what a compilation makes.
_NOT_IN_KEY: Final = frozenset({"cache", "cache_agree"})

_store_lock = threading.Lock()
_stores: dict[loom_cache.CacheConfig, loom_cache.TieredStore] = {}


def cache_store(config: loom_cache.CacheConfig | None = None) -> loom_cache.TieredStore:
    """The process's store for ``config``: by default the cache settings
    (``TORCHLOOM_CACHE_*``, ``TORCHLOOM_REMOTE_CACHE*``) as ``loom_cache`` resolves
    them, once per distinct setting; one store (and one circuit breaker) per setting."""
    config = config if config is not None else loom_cache.CacheConfig.from_env()
    with _store_lock:
        if config not in _stores:
            _stores[config] = loom_cache.open_default_store(config)
        return _stores[config]


@dataclasses.dataclass(frozen=True, slots=True)
class Artifact:
    """What a hit needs: AOTAutograd's bundled result, the report the cold
    compilation made (entries and graphs) and the payloads of the steps that
    re-make their own entries on a hit, by area (``"cudagraph"``: its plans)."""

    format: int
    aot_result: bytes
    entries: tuple[tuple[str, str, str, tuple[tuple[str, Any], ...]], ...]
    graphs: tuple[tuple[str, str], ...]
    stages: tuple[tuple[str, Any], ...] = ()


def _versions(pipeline: Sequence[str] = (), modules: Sequence[str] = _LOOM_MODULES) -> str:
    """Versions of loom's distributions, the hash of its source and the pipeline's
    extra parts (:meth:`Pipeline.describe`): a pipeline with other passes never
    shares an entry."""
    parts = [f"part={p}" for p in pipeline]
    parts.extend(_installed_versions())
    parts.append(f"source={loom_source_hash(tuple(modules))}")
    return ";".join(parts)


@functools.cache
def _installed_versions() -> tuple[str, ...]:
    """``dist=version`` of each installed loom distribution, read once per process
    (each read scans the installed metadata)."""
    parts = []
    for dist in LOOM_DISTRIBUTIONS:
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(parts)


@functools.cache
def loom_source_hash(modules: tuple[str, ...] = _LOOM_MODULES) -> str:
    """A hash of the source files of every loom package, read once per process.

    Versions alone do not change while loom is developed (an editable install
    keeps 0.1.0 across edits); the source does, so an edited pass never meets
    an artifact its old code made (Inductor keys on torch's source the same way).
    """
    digest = hashlib.sha256()
    for name in modules:
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
    """What the graph was compiled from (explanations and ``torchloom cache list``
    only; not in the key's digest): ``file:function`` of the user code, else, for a
    module whose code is all torch's (``nn.Sequential`` of torch layers: its nodes
    carry no user frame), ``module:Class.forward`` of the outermost module."""
    for node in gm.graph.nodes:
        frame = user_frame(node.meta.get("stack_trace"))
        if frame is not None:
            return f"{os.path.basename(frame.file)}:{frame.function}"
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            _, cls = next(iter(stack.values()))  # outermost first
            if isinstance(cls, type):
                return f"{cls.__module__}:{cls.__qualname__}.forward"
            return f"{cls}.forward"
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


def _bypass(record: GraphRecordBuilder, bypass: loom_cache.CacheBypass) -> loom_cache.CacheBypass:
    record.add_entry("cache", "bypass", str(bypass), kind_=bypass.kind.value, where=bypass.where)
    if bypass.kind is not loom_cache.CacheBypassKind.DISABLED:
        log.info("graph %d: %s", record.graph_id, bypass)
    return bypass


def _make_key(
    snapshot: Snapshot,
    hooks: HooksPlan,
    settings: Mapping[str, Mapping[str, Any] | None],
    pipeline: Sequence[str],
) -> loom_cache.CacheKey | loom_cache.CacheBypass:
    options = snapshot.options
    if not options.cache:  # TORCHLOOM_CACHE is resolved into the options, once
        return loom_cache.CacheBypass(
            loom_cache.CacheBypassKind.DISABLED, "options", "the loom cache is off"
        )
    if compat.caches_force_disabled():
        return loom_cache.CacheBypass(
            loom_cache.CacheBypassKind.DISABLED,
            "torch.compiler.config.force_disable_caches",
            "PyTorch's caches are force-disabled",
        )
    if hooks.pair is not None and hooks.fingerprint is None:
        return loom_cache.CacheBypass(
            loom_cache.CacheBypassKind.UNHASHABLE_CLOSURE,
            "active saved_tensors_hooks",
            "the hooks have no process-stable fingerprint",
            "capture plain values in the hooks, or give captured objects a `cache_hash`",
        )
    fp = loom_cache.graph_fingerprint(snapshot.gm)
    if fp.bypass is not None:
        return fp.bypass
    hooks_component = loom_cache.KeyComponent(
        "hooks",
        loom_cache.stable_digest(hooks.fingerprint or "none"),
        "none" if hooks.pair is None else f"saved_tensors_hooks {hooks.fingerprint}",
    )
    components = [hooks_component]
    for name, values in settings.items():
        if values is not None:
            items = dict(sorted(values.items()))
            components.append(
                loom_cache.KeyComponent(
                    name,
                    loom_cache.stable_digest(items),
                    json.dumps(items, sort_keys=True, default=str),
                )
            )
    return loom_cache.make_key(
        _program(snapshot.gm),
        fp,
        device=_device(snapshot.example_inputs),
        backend=("loom", _versions(pipeline)),
        options={k: v for k, v in options.as_dict().items() if k not in _NOT_IN_KEY},
        extra=components,
    )


def cache_key(
    snapshot: Snapshot,
    hooks: HooksPlan,
    settings: Mapping[str, Mapping[str, Any] | None],
    pipeline: Sequence[str] = (),
) -> loom_cache.CacheKey | loom_cache.CacheBypass:
    """The graph's key, or why it bypasses the cache (recorded in the report).

    ``settings`` are key components beyond the options, by name (the CUDA-graph
    settings; ``None``: nothing for this graph); ``pipeline`` names the
    pipeline's extra parts.
    """
    try:
        key = _make_key(snapshot, hooks, settings, pipeline)
    except compat.CONTROL_FLOW_EXCEPTIONS:
        raise
    except Exception as err:  # the cache never fails a compile
        log.warning(
            "graph %d: loom cache key failed, compiling without it: %r", snapshot.graph_id, err
        )
        key = loom_cache.CacheBypass(
            loom_cache.CacheBypassKind.UNHASHABLE_CONSTANT, "key", f"{type(err).__name__}: {err}"
        )
    if isinstance(key, loom_cache.CacheBypass):
        return _bypass(snapshot.record, key)
    return key


@dataclasses.dataclass(frozen=True, slots=True)
class CacheLookup:
    """What the store holds for a key: an artifact to serve, or why there is none."""

    key: loom_cache.CacheKey
    store: loom_cache.TieredStore
    artifact: Artifact | None
    reason: str


def look_up(store: loom_cache.TieredStore, key: loom_cache.CacheKey) -> CacheLookup:
    """The stored artifact for ``key``; an unreadable one is deleted and is a miss."""
    try:
        found = store.lookup(key.digest)
    except Exception as err:
        return CacheLookup(key, store, None, f"lookup failed: {type(err).__name__}: {err}")
    if found.entry is None:
        return CacheLookup(key, store, None, found.reason)
    try:
        artifact = pickle.loads(found.entry.payload)
        if not isinstance(artifact, Artifact) or artifact.format != ARTIFACT_FORMAT:
            raise TypeError("not a loom artifact of this format")
    except Exception as err:
        store.delete(key.digest)
        return CacheLookup(key, store, None, f"unreadable artifact: {type(err).__name__}: {err}")
    return CacheLookup(key, store, artifact, "hit")


def replay_artifact(
    record: GraphRecordBuilder,
    artifact: Artifact,
    replay: Mapping[str, Callable[[Any], None]],
) -> None:
    """A hit: the report entries and graphs the cold compilation made, then each
    stored payload handed back to the step that re-makes its own entries."""
    for area, kind, message, data in artifact.entries:
        record.add_entry(area, kind, message, **dict(data))
    for kind, code in artifact.graphs:
        record.add_graph(kind, code)
    for area, payload in artifact.stages:
        if area in replay:
            replay[area](payload)


def record_hit(record: GraphRecordBuilder, lookup: CacheLookup) -> None:
    lookup.store.local.record(hit=True)
    key = lookup.key
    record.add_entry(
        "cache", "hit", f"loom cache hit {key.digest[:16]} ({key.program})", digest=key.digest
    )


def record_miss(record: GraphRecordBuilder, lookup: CacheLookup, reason: str) -> None:
    """A miss: why, and how the key differs from the nearest stored entry."""
    store, key = lookup.store, lookup.key
    explanation = ""
    try:
        store.local.record(hit=False)
        store.local.record_miss(key)
        # The index names each entry's program: only that program's headers are read.
        same = (s.digest for s in store.local.summaries() if s.program == key.program)
        infos = (store.local.info(d) for d in same)
        nearest = loom_cache.nearest_key(key, (i.key for i in infos if i is not None))
        if nearest is not None:
            diffs = loom_cache.explain_miss(key, nearest)
            explanation = "; ".join(str(d) for d in diffs)
    except Exception as err:
        explanation = f"(no explanation: {err})"
    message = f"loom cache miss {key.digest[:16]} ({key.program}): {reason}"
    if explanation:
        message += f"; differs from the nearest entry in {explanation}"
    record.add_entry("cache", "miss", message, digest=key.digest)
    log.info("graph %d: %s", record.graph_id, message)


@dataclasses.dataclass(frozen=True, slots=True)
class CacheRun:
    """A keyed cold compilation: the lookup that missed, the AOTAutograd cache slot
    its result lands in (:class:`AotCacheSlot`, which AOTAutograd writes to), which
    report entries and graphs are its own (those after ``first_*``) and the payloads
    the stored artifact carries besides, by area, made at store time."""

    lookup: CacheLookup
    slot: AotCacheSlot
    first_entry: int
    first_graph: int
    payloads: Callable[[], Mapping[str, Any]]


#: What the backward compiler calls when the entry waits for a lazily compiled backward.
StoreAfterBackward = Callable[[], None]


def finish_cold(
    record: GraphRecordBuilder,
    run: CacheRun,
    compiled: Collection[GraphKind],
    not_cacheable: str | None,
) -> StoreAfterBackward | None:
    """After a cold compile that made the aten graphs ``compiled``: record the miss,
    then store the artifact now (``None``), or return what the backward compiler
    calls to store it, when AOTAutograd compiles the backward at its first call.

    ``not_cacheable`` says why the compilation is not what the key promises (hooks
    left eager), if so: then nothing is stored.
    """
    record_miss(record, run.lookup, run.lookup.reason)
    if set(compiled) == {GraphKind.FORWARD} and not run.slot.save_attempted:
        record.add_entry(
            "cache",
            "pending",
            "the backward compiles at its first call: the entry is stored after it",
            digest=run.lookup.key.digest,
        )
        return functools.partial(_store_after_backward, record, run, not_cacheable)
    store_compilation(record, run, not_cacheable)
    return None


def _store_after_backward(
    record: GraphRecordBuilder, run: CacheRun, not_cacheable: str | None
) -> None:
    """Called as a lazily compiled backward is generated: the entry AOTAutograd saves
    right after is routed to this compilation's slot, then stored."""
    # NOTE: AOTAutograd makes and saves the complete entry right after this compiler
    # returns, outside our compilation's slot routing.
    save = functools.partial(_store_late, record, run, not_cacheable)
    route_lazy_backward_save(run.slot, save)


def _store_late(record: GraphRecordBuilder, run: CacheRun, not_cacheable: str | None) -> None:
    try:
        store_compilation(record, run, not_cacheable)
    except Exception as err:  # inside the user's backward: the cache never fails it
        log.warning("graph %d: could not store the compiled artifact: %r", record.graph_id, err)


def store_compilation(
    record: GraphRecordBuilder, run: CacheRun, not_cacheable: str | None = None
) -> None:
    """Store the cold compilation's artifact, unless it is not what the key promises
    (it fell back, or ``not_cacheable`` says why)."""
    store, key, slot = run.lookup.store, run.lookup.key, run.slot
    built = record.build()
    if built.fallback is not None or not_cacheable is not None:
        record.add_entry(
            "cache",
            "not-stored",
            "the compilation fell back or left the hooks eager; nothing stored",
        )
        return
    if slot.saved is None:
        _bypass(
            record,
            loom_cache.CacheBypass(
                loom_cache.CacheBypassKind.UNSERIALIZABLE_ARTIFACT,
                "AOTAutograd result",
                slot.save_error or "AOTAutograd produced no cacheable result",
            ),
        )
        return
    try:
        stages = tuple((area, p) for area, p in run.payloads().items() if p is not None)
        owned = {"cache", *(area for area, _ in stages)}
        entries = tuple(
            (e.area, e.kind, e.message, _picklable(e.data))
            for e in built.entries[run.first_entry :]
            if e.area not in owned
        )
        graphs = built.graphs[run.first_graph :]
        artifact = Artifact(ARTIFACT_FORMAT, slot.saved, entries, graphs, stages)
        payload = pickle.dumps(artifact)
        put = store.put(loom_cache.Entry(key, payload, (("loom", _versions()),)))
    except Exception as err:
        log.warning("graph %d: could not store the compiled artifact: %r", record.graph_id, err)
        record.add_entry("cache", "not-stored", f"store failed: {err}")
        return
    if not put.stored:  # the store logged why (once)
        record.add_entry("cache", "not-stored", f"not stored: {put.reason}", digest=key.digest)
        return
    record.add_entry(
        "cache", "stored", f"stored {key.digest[:16]} ({len(payload)} bytes)", digest=key.digest
    )
