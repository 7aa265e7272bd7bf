"""The active ``saved_tensors_hooks`` pair: snapshot, identity and content hash.

A :class:`HookPair` is what ``torch.autograd.graph.saved_tensors_hooks(pack,
unpack)`` made active at compile time. Its *content* (code, defaults, the
closure values its traces read; ``loom_hops.pair_mismatch``) decides at each
call whether a compilation may be reused, so a pair made anew with the same
content reuses it; its *fingerprint* (content, stable across processes) joins
cache keys, and is ``None`` for hooks whose content cannot be hashed (opaque
``torch.fx.wrap`` calls without ``user_cache_hash``), which then bypass the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from loom_hops._torch_compat import is_torch_op, top_saved_tensors_hooks

__all__ = [
    "HookPair",
    "active_saved_tensors_hooks",
    "feed_graph",
    "fingerprint_hooks",
    "same_pair",
]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class HookPair:
    """The ``(pack, unpack)`` pair active when a graph was compiled.

    ``same_pair`` compares the two objects; whether a compilation serves another
    pair is a question of content (``loom_hops.pair_mismatch``).
    """

    pack: Callable[[torch.Tensor], Any]
    unpack: Callable[[Any], torch.Tensor]

    @property
    def kind(self) -> str:
        """``"graph_module"``, ``"python"`` or ``"mixed"``."""
        gms = [isinstance(h, torch.fx.GraphModule) for h in (self.pack, self.unpack)]
        return "graph_module" if all(gms) else "python" if not any(gms) else "mixed"

    def is_active(self) -> bool:
        """Whether this very pair is the innermost active one now."""
        return same_pair(self, active_saved_tensors_hooks())

    def describe(self) -> str:
        return f"pack={_where(self.pack)}, unpack={_where(self.unpack)} ({self.kind})"


def same_pair(a: HookPair | None, b: HookPair | None) -> bool:
    """Identity comparison of two snapshots (``None`` means no hooks)."""
    if a is None or b is None:
        return a is b
    return a.pack is b.pack and a.unpack is b.unpack


def active_saved_tensors_hooks() -> HookPair | None:
    """The innermost active pair, or ``None`` (read even while Dynamo traces)."""
    raw = top_saved_tensors_hooks()
    return None if raw is None else HookPair(raw[0], raw[1])


def _where(fn: Any) -> str:
    if isinstance(fn, torch.fx.GraphModule):
        return f"GraphModule {type(fn).__name__}"
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if code is None:
        return str(name)
    return f"{name} at {code.co_filename}:{code.co_firstlineno}"


def feed_graph(gm: torch.fx.GraphModule, h: Any) -> bool:
    """Feed ``gm``'s structure to ``h``; ``False`` if an opaque call has no user_cache_hash."""
    names: dict[str, str] = {}
    for node in gm.graph.nodes:
        names[node.name] = f"v{len(names)}"
        target = node.target
        if node.op == "call_function" and not is_torch_op(target):
            module = getattr(target, "__module__", "") or ""
            if not (module.startswith("torch") or module in ("_operator", "operator", "builtins")):
                user_hash = node.meta.get("user_cache_hash")
                if user_hash is None:
                    return False
                target = f"user:{user_hash}"
        if node.op == "get_attr":
            value: Any = gm
            for part in str(target).split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                h.update(f"{value.dtype}{list(value.shape)}".encode())
                h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        args = torch.fx.map_arg((node.args, node.kwargs), lambda n: names[n.name])  # type: ignore[arg-type]
        h.update(f"{node.op}|{_target_name(target)}|{args!r};".encode())
    return True


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def fingerprint_hooks(pair: HookPair | None, tracer_fingerprint: str | None = None) -> str | None:
    """A process-stable hash of the pair's content, or ``None`` to bypass caches.

    ``GraphModule`` hooks hash their graphs (nodes renamed by first appearance,
    constants by value); a call to a non-torch function (``torch.fx.wrap``)
    needs ``node.meta["user_cache_hash"]``. Python hooks use the fingerprint
    the hook tracer computed (``tracer_fingerprint``).
    """
    if pair is None:
        return "no-hooks"
    if pair.kind == "python":
        return tracer_fingerprint
    if pair.kind != "graph_module":
        return None
    h = hashlib.sha256(b"loom-saved-tensor-hooks-v1;")
    for gm in (pair.pack, pair.unpack):
        assert isinstance(gm, torch.fx.GraphModule)
        if not feed_graph(gm, h):
            return None
        h.update(b"|")
    return h.hexdigest()
