"""Copies of a model that share its weights: how fast paths and probes change a model without
touching the one the caller holds.

`copy_modules(model, replace)` rebuilds the module tree, giving `replace` each module on the way
down; whatever it returns takes that module's place in the copy (None keeps a shallow copy).
Every module object is new, but parameters and buffers are the same tensors in both trees, so a
copy costs no weight memory, and setting an attribute or a parameter on a copy leaves the original
as it was. A module reached twice (the verifier's embedding, which a draft borrows) is copied once.

`variant(model, {"layers.0.self_attn.rotary.interleave": False})` is such a copy with plain
attributes changed along the named paths: the doctor's and the fusion ablation's probes.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping

from torch import nn

REMOVED = object()  # as a value in `variant`: delete the attribute (a draft's own embedding, say)
Replace = Callable[[nn.Module, str], "nn.Module | None"]


def shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object holding the same tensors, in dicts of its own (children, parameters, buffers)."""
    new = copy.copy(module)
    new._modules, new._parameters, new._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return new


def copy_modules(model: nn.Module, replace: Replace | None = None, memo: dict | None = None,
                 name: str = "") -> nn.Module:
    """A copy of `model`'s module tree, each module passed to `replace(module, name)` first.

    `replace` sees the original module (its children not yet copied) and its attribute name in its
    parent, and returns its stand-in, or None for a plain shallow copy; either way the stand-in's
    children are then copied in turn. `memo` maps id(original) -> copy and may be shared between
    calls, so that models which share modules (a draft and its verifier) keep sharing their copies.
    """
    memo = {} if memo is None else memo
    if id(model) in memo:
        return memo[id(model)]
    new = (replace(model, name) if replace else None) or shallow_copy(model)
    memo[id(model)] = new
    for child_name, child in list(new._modules.items()):
        if child is not None:
            new._modules[child_name] = copy_modules(child, replace, memo, child_name)
    borrowed = getattr(new, "_shared", None)  # modules a draft borrows from its verifier
    if isinstance(borrowed, dict):
        new._shared = {k: copy_modules(m, replace, memo, k) for k, m in borrowed.items()}
    return new


def variant(model: nn.Module, changes: Mapping[str, object], memo: dict | None = None) -> nn.Module:
    """A weight-sharing copy of `model` with attributes set: {"dotted.path.attr": value} (or REMOVED).

    The caller's model is unchanged. A path that names no attribute is an error naming it.
    """
    new = copy_modules(model, memo=memo)
    for path, value in changes.items():
        *parents, attr = path.split(".")
        owner = new
        for name in parents:
            owner = owner._modules.get(name) if isinstance(owner, nn.Module) else None
            if owner is None:
                raise AttributeError(f"variant: {type(model).__name__} has no module {'.'.join(parents)!r} "
                                     f"(in {path!r})")
        if not hasattr(owner, attr) and not isinstance(value, nn.Module):  # a new child module may be added
            raise AttributeError(f"variant: {type(owner).__name__} at {'.'.join(parents) or 'the top'} has no "
                                 f"attribute {attr!r} (in {path!r})")
        if value is REMOVED:
            delattr(owner, attr)
        else:
            setattr(owner, attr, value)
    return new
