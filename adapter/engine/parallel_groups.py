"""The group handles the pack reads from the engine's runtime context at run time
(`get_parallel().tp_group`, `.attn_tp_group`), shown at plan time: a release that renamed
or rerouted them is refused at start, naming the symbol, not met at the first decode step.

Two layouts, each read the same way from the installed engine and from its sources:
- 0.5.16 - 0.5.20: ParallelContext defines a property per group that returns
  parallel_state's getter (`self._v("tp_group", _ps().get_tp_group)`);
- 0.5.21 - 0.5.23: the class defines none in its source. `Parallel` (arg_groups/fields/
  parallel.py) declares each group as `Derived(...)`, runtime_context installs a property per
  declaration at import (`_install_parallel_properties`: `setattr(ParallelContext, name,
  property(getter))`, the getter `self._read(name)`), and parallel_state writes the built groups
  by those names (`"tp_group": _TP, ...` handed to `get_parallel().override_permanently`).
  Installed, the class carries the installed properties, whose getter names no getter of
  parallel_state: that side is judged by the same declarations as the sources.
"""

from __future__ import annotations

import ast
import inspect

from .contract import Contract, source_proof, target_modules
from .syntax import parse

RUNTIME_CONTEXT = "sglang.srt.runtime_context"
FIELDS = "sglang.srt.arg_groups.fields.parallel"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"
GROUPS = ("tp_group", "attn_tp_group")
INSTALLER = "_install_parallel_properties"
INSTALLS = "setattr(ParallelContext, name, property("


def _getter_source(contract: Contract, name: str):
    """The source of ParallelContext.<name>'s getter where the class defines it as a
    property, else None."""
    found = vars(contract.attr("ParallelContext")).get(name)
    if not isinstance(found, property) or found.fget is None:
        return None
    text = getattr(found.fget, "__source_text__", None)  # read from source
    if text is not None:
        return text
    try:
        return inspect.getsource(found.fget)
    except (OSError, TypeError) as exc:
        raise contract.refuse(f"ParallelContext.{name}", f"getter source is unreadable ({exc})")


@source_proof("parallel-groups-declared")
def _declared(contract: Contract, name: str) -> bool:
    """`name = Derived(...)` in class Parallel's own body."""
    for node in parse(contract.source()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Parallel":
            return any(isinstance(item, ast.Assign) and isinstance(item.value, ast.Call)
                       and ast.unparse(item.value.func).split(".")[-1] == "Derived"
                       and any(isinstance(t, ast.Name) and t.id == name for t in item.targets)
                       for item in node.body)
    raise contract.refuse("Parallel", "missing: the class that declares the runtime context's groups")


@source_proof("parallel-groups-called-at-import")
def _called_at_import(contract: Contract, function: str) -> bool:
    """`function()` is called at the module's top level."""
    called = (node.value for node in parse(contract.source()).body if isinstance(node, ast.Expr))
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == function for c in called)


def check(adapter: str, engine) -> str:
    """Refused unless `get_parallel().tp_group` and `.attn_tp_group` are shown to be the
    groups parallel_state builds; returns what showed it."""
    context = Contract(adapter, target_modules(adapter, engine, ((RUNTIME_CONTEXT, True),))[RUNTIME_CONTEXT])
    if not callable(context.attr("get_parallel")):
        raise context.refuse("get_parallel", "is no longer callable")
    returned, declared = [], []  # shown by their own getters; to be shown by the Derived declarations
    for name in GROUPS:
        text = _getter_source(context, name)
        if text is not None and f"get_{name}" in text:
            returned.append(name)
        elif text is None or "_read(" in text:
            declared.append(name)
        else:
            raise context.refuse(f"ParallelContext.{name}", f"no longer returns parallel_state's get_{name}()")
    shown = f"{RUNTIME_CONTEXT}.ParallelContext's {' and '.join(returned)} return parallel_state's getters"
    if not declared:
        return shown
    if not hasattr(context.module, INSTALLER):
        raise context.refuse(f"ParallelContext.{declared[0]}", f"is no longer a property returning parallel_state's "
                                                               f"get_{declared[0]}(), and no {INSTALLER} installs it")
    installer = context.function_source(INSTALLER)
    if INSTALLS not in installer or "Derived" not in context.function_source("_derived_widths"):
        raise context.refuse(INSTALLER, f"no longer reads `{INSTALLS}` over Parallel's Derived declarations")
    if not _called_at_import(context, INSTALLER):
        raise context.refuse(INSTALLER, "is no longer called when the module is imported")
    modules = target_modules(adapter, engine, ((FIELDS, True), (PARALLEL_STATE, True)))
    fields, state = Contract(adapter, modules[FIELDS]), Contract(adapter, modules[PARALLEL_STATE])
    written = state.source()
    for name in declared:
        if not _declared(fields, name):
            raise fields.refuse(f"Parallel.{name}", "is no longer declared Derived: the runtime context has no such group")
        if f'"{name}": ' not in written or "override_permanently(" not in written:
            raise state.refuse(name, "is no longer written into the runtime context by name")
    derived = (f"{' and '.join(declared)} declared Derived on {FIELDS}.Parallel, installed on ParallelContext by "
               f"{INSTALLER} and written by {PARALLEL_STATE}")
    return f"{shown}; {derived}" if returned else derived
