"""The fields of whatever the engine hands back, read and replaced whatever its shape.

The fence copies what the engine returns and the boundary walks what leaves the worker;
neither may assume the shape it was written against. A result may be a msgspec struct,
a dataclass (slotted, frozen), a namedtuple or tuple, a list, a dict, or any object with
attributes, and a subclass may add fields. `items` reads every field of an object's
actual type; `replaced` makes a copy of the same type with some fields changed and every
other carried over, running none of the engine's code (no __init__, __post_init__ or
__setattr__ of the class).
"""

from __future__ import annotations

import copy

try:
    from msgspec import Struct
    from msgspec.structs import force_setattr
except ImportError:  # the engine always has msgspec; the pack's tools may run without it
    Struct, force_setattr = (), None

# What a value is to a walk: nothing to look into, a tensor, a sequence, a mapping, or an
# object with fields.
LEAF, TENSOR, SEQUENCE, MAPPING, HOLDER = "leaf", "tensor", "sequence", "mapping", "holder"

KINDS: dict = {}   # type -> kind, filled as types are met
_layouts: dict = {}  # type -> (names stored outside __dict__, whether instances have a __dict__)
_UNSET = object()


def kind(tp: type) -> str:
    found = KINDS.get(tp)
    if found is None:
        found = KINDS[tp] = _kind_of(tp)
    return found


def _kind_of(tp: type) -> str:
    import enum
    import types

    import torch

    if issubclass(tp, torch.Tensor):
        return TENSOR
    if issubclass(tp, (list, tuple)):
        return SEQUENCE
    if issubclass(tp, dict):
        return MAPPING
    if issubclass(tp, (type(None), int, float, complex, str, bytes, enum.Enum, type, types.ModuleType,
                       types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device)):
        return LEAF
    names, has_dict = layout(tp)
    return HOLDER if names or has_dict else LEAF


def layout(tp: type) -> tuple[tuple, bool]:
    """The field names an instance stores outside its __dict__ (msgspec struct fields, the
    __slots__ of every class in its MRO), and whether it has a __dict__."""
    found = _layouts.get(tp)
    if found is None:
        names = list(getattr(tp, "__struct_fields__", ()))
        for cls in tp.__mro__:
            slots = vars(cls).get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{cls.__name__.lstrip('_')}{name}"  # a private slot's stored name
                if name not in ("__dict__", "__weakref__") and name not in names:
                    names.append(name)
        found = _layouts[tp] = (tuple(names), tp.__dictoffset__ != 0)
    return found


def items(obj):
    """(key, value) for every field of `obj`'s actual type: indices of a sequence, keys of
    a mapping, field and slot names and instance attributes of anything else (nothing for
    a tensor or a plain value). A live view where one exists: not to be changed while read."""
    what = kind(type(obj))
    if what is SEQUENCE:
        return enumerate(obj)
    if what is MAPPING:
        return obj.items()
    if what is not HOLDER:
        return ()
    names, has_dict = layout(type(obj))
    if not names:
        return vars(obj).items()
    found = [(name, value) for name in names if (value := getattr(obj, name, _UNSET)) is not _UNSET]
    return found + list(vars(obj).items()) if has_dict else found


def replaced(obj, changes: dict):
    """A copy of `obj`, of its own type, with `changes` (key -> value, keys as `items`
    gives them) and every other field as it was."""
    if isinstance(obj, tuple):  # namedtuples too: tuple.__new__ is what their _make calls
        values = list(obj)
        for index, value in changes.items():
            values[index] = value
        return tuple.__new__(type(obj), values)
    fresh = copy.copy(obj)
    if isinstance(obj, (list, dict)):
        for key, value in changes.items():
            fresh[key] = value
        return fresh
    setter = force_setattr if isinstance(obj, Struct) else object.__setattr__  # frozen ones too
    for name, value in changes.items():
        setter(fresh, name, value)
    return fresh
