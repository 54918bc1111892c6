"""A detached copy of DSpark's accept results, made cheaply and safely.

The folded accept leaves six small tensors (`AcceptOuts`) in the verify graph's
persistent buffers. The fence needs a copy of them that no later replay touches,
queued on the forward stream right where they escape. Six `clone()` calls do it (six
allocations, six kernel launches: about +55-75 us host time per verify step on an
H200), and that is what this module does on the CPU and whenever the fast path is
not available.

The fast path, for CUDA tensors, is one call into a small compiled kernel library
that takes ONE block from PyTorch's caching allocator, fills it with ONE kernel
launch on the current stream, and returns six typed tensors that share that block.
The copy is fresh memory, so it is correct by construction for every consumer:
Python references keep the block alive, and the scheduler's readback (`record_stream`
on its copy stream) keeps the allocator from reusing the block until the copy ran,
exactly as for a clone. No preallocated slot is ever rewritten.

Nothing is compiled at run time. The image build compiles the library once
(`python3 -P -m sglang_dsv41_adapters.folded_fence.accept_snapshot build --archs "9.0 10.0"`: torch's
`load_inline` into a temporary folder, checked by loading it in a fresh interpreter,
then moved to its path); each process loads that file by path with Python's own
extension loader, the first time it is needed: no JIT cache, no lock, nothing
written, any user, read-only file systems. The path is $SGLANG_ADAPTERS_SNAPSHOT_KERNEL,
else DEFAULT_PATH. If the file is missing, does not load, was built from other
sources or another torch, or holds no code for this GPU, the clones serve and
`copy_mode()` says why: the values are the same either way, only the cost differs.

The same library serves two more callers on the eager decode path (one launch where torch costs
several in host time), offered to them
through spectpsync.library: `pack` (snapshot's block, plus the block itself as one flat tensor,
for the rank-0 broadcast's one collective), `count_divergence` and `count_pair` (the divergence
report's fused comparison, one launch per site call), `receive` (the tensor a rank receives
rank 0's value into at a report site: one kept block per stream) and `report_sync` (the
report's wrapper of SpecTpSync.sync, its common eager call in C).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

from . import holders
from ..framework import log, metrics
from ..spectpsync import library as shared_library

__all__ = ["copy_mode", "expected_mode", "snapshot", "detach", "kernel_path", "extension", "use_extension", "build"]

PATH_ENV = "SGLANG_ADAPTERS_SNAPSHOT_KERNEL"  # not DSV41_*: those are the pack's flags
MODULE = "dsv41_accept_snapshot"              # the library's Python module name (PyInit_<MODULE>)
DEFAULT_PATH = f"/opt/sglang-dsv41/{MODULE}.so"
DEFAULT_ARCHS = "9.0 10.0"                    # Hopper and Blackwell data-centre parts

# The boundary check's native scan (fence_boundary): host-side C++ over the CPython API, no
# CUDA, in the bindings' file. `boundary_scan(...)` binds the walk's tables and one epilogue's
# memory map, and returns a plain CPython callable `scan(result, epilogue)`: True only where
# the map still holds (fence_boundary._fresh) and fence_boundary's Python walk would find no
# route and report nothing; False (unsure) for anything it does not read exactly as that walk
# does, which then runs the walk. `boundary_check(...)` is fence_boundary.check_results in C
# over those scans, `report_sync(...)` tp_divergence's wrapper of SpecTpSync.sync in C (its
# common eager call), `views_check()` the cheap form's per-call test of its cached views
# (views_current): each hands its Python form what it does not do itself.
_SCAN_SOURCE = r"""
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/impl/COW.h>
#include <algorithm>
#include <cstdint>

namespace {
// One holder of the epilogue's memory as fence_boundary._map walked it.
struct Node {
  PyObject* holder;              // nullptr: the epilogue itself
  std::vector<PyObject*> slots;  // the values it held, or the free / beyond markers (owned references)
};

struct BoundaryScan {
  PyObject* kinds;    // holders.KINDS: type -> kind (owned references, all of them)
  PyObject* layouts;  // holders._layouts: type -> (names outside __dict__, has __dict__)
  PyObject *leaf, *tensor, *sequence, *mapping, *holder;  // the kind strings, compared by identity
  PyObject *plain_tensor, *parameter;                     // the tensor types read directly
  PyObject* dict_name;
  PyObject* owner;                  // a weak reference to the epilogue (or the epilogue, where it takes none)
  PyObject *free, *beyond, *any;    // fence_boundary._FREE, _BEYOND and _ANY
  std::vector<Node> nodes;          // the epilogue's memory as mapped ...
  std::vector<PyObject*> tensors;   // ... the tensors in it ...
  std::vector<uintptr_t> addresses; // ... and their storages' addresses then
  std::vector<uintptr_t> storages;  // the map's storages
  int max_depth;
  long max_values;
  ~BoundaryScan() {
    for (PyObject* o : {kinds, layouts, leaf, tensor, sequence, mapping, holder, plain_tensor, parameter, dict_name,
                        owner, free, beyond, any}) Py_XDECREF(o);
    for (Node& n : nodes) {
      Py_XDECREF(n.holder);
      for (PyObject* o : n.slots) Py_XDECREF(o);
    }
    for (PyObject* o : tensors) Py_XDECREF(o);
  }
};

// Where a tensor's storage lies; false where it has none to read here (data_ptr() would
// materialize a copy-on-write one).
bool address_of(const at::Tensor& t, uintptr_t& address) {
  if (!t.has_storage()) return false;
  const c10::Storage& storage = t.storage();
  if (c10::impl::cow::is_cow_data_ptr(storage.data_ptr())) return false;
  address = reinterpret_cast<uintptr_t>(storage.data());
  return true;
}

// Each item a list or tuple `h` stores, then each value a dict `d` stores, handed to `f` (kept
// alive around the call; its false stops the reading and is returned).
template <typename F>
bool each_item(PyObject* h, F&& f) {
  const bool list = PyList_Check(h);
  for (Py_ssize_t i = 0; i < (list ? PyList_GET_SIZE(h) : PyTuple_GET_SIZE(h)); ++i) {
    PyObject* v = list ? PyList_GET_ITEM(h, i) : PyTuple_GET_ITEM(h, i);
    Py_INCREF(v);
    const bool go_on = f(v);
    Py_DECREF(v);
    if (!go_on) return false;
  }
  return true;
}

template <typename F>
bool each_stored(PyObject* d, F&& f) {
  const Py_ssize_t size = PyDict_GET_SIZE(d);
  Py_ssize_t at = 0;
  PyObject *key, *v;
  while (PyDict_Next(d, &at, &key, &v)) {
    Py_INCREF(v);
    const bool go_on = f(v);
    Py_DECREF(v);
    if (!go_on || PyDict_GET_SIZE(d) != size) return false;
  }
  return true;
}

// holders.items(h)'s values, in its order, each handed to `f` (its false stops the reading); false
// also where h is not read here exactly as holders.items reads it.
template <typename F>
bool each_value(const BoundaryScan& s, PyObject* h, F&& f) {
  PyTypeObject* tp = Py_TYPE(h);
  PyObject* kind = PyDict_GetItemWithError(s.kinds, (PyObject*)tp);
  if (kind == nullptr) return false;
  if (kind == s.leaf || kind == s.tensor) return true;  // items() gives nothing
  if (kind == s.sequence) {  // enumerate(h): the base type's own iterator only
    const bool list = PyList_Check(h) && tp->tp_iter == PyList_Type.tp_iter;
    if (!list && !(PyTuple_Check(h) && tp->tp_iter == PyTuple_Type.tp_iter)) return false;
    return each_item(h, f);
  }
  if (kind == s.mapping) return PyDict_CheckExact(h) && each_stored(h, f);  // a subclass may read otherwise
  if (kind != s.holder) return false;
  PyObject* layout = PyDict_GetItemWithError(s.layouts, (PyObject*)tp);
  if (layout == nullptr || !PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 2) return false;
  PyObject* names = PyTuple_GET_ITEM(layout, 0);
  if (!PyTuple_CheckExact(names)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {  // getattr(h, name, _UNSET)
    PyObject* v = PyObject_GetAttr(h, PyTuple_GET_ITEM(names, i));
    if (v == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return false;
      PyErr_Clear();
      continue;
    }
    const bool go_on = f(v);
    Py_DECREF(v);
    if (!go_on) return false;
  }
  if (PyTuple_GET_SIZE(names) != 0 && PyTuple_GET_ITEM(layout, 1) != Py_True) return true;
  PyObject* d = PyObject_GetAttr(h, s.dict_name);  // vars(h)
  if (d == nullptr) return false;
  const bool done = PyDict_CheckExact(d) && each_stored(d, f);
  Py_DECREF(d);
  return done;
}

// fence_boundary._held: what a holder of the epilogue's memory holds, a list's, tuple's or
// dict's own storage whatever its type (an OrderedDict of nn.Module's hooks too), else
// holders.items(h).
template <typename F>
bool each_held(const BoundaryScan& s, PyObject* h, F&& f) {
  if (PyList_Check(h) || PyTuple_Check(h)) return each_item(h, f);
  if (PyDict_Check(h)) return each_stored(h, f);
  return each_value(s, h, f);
}

struct Walk {
  const BoundaryScan& s;
  PyObject* epilogue;
  long left;
  bool value(PyObject* v, int level);
  bool holder(PyObject* h, int level) {
    return each_value(s, h, [&](PyObject* v) { return value(v, level); });
  }
};

// One value a holder at `level` holds: true where the Python walk skips it or finds it clean.
bool Walk::value(PyObject* v, int level) {
  if (v == Py_None) return true;
  PyObject* kind = PyDict_GetItemWithError(s.kinds, (PyObject*)Py_TYPE(v));
  if (kind == nullptr) return false;  // a type the walk has not met: it fills KINDS
  if (kind == s.leaf || v == epilogue) return true;
  if (--left < 0) return false;  // the walk's cut
  if (kind == s.tensor) {
    PyObject* tp = (PyObject*)Py_TYPE(v);
    if (tp != s.plain_tensor && tp != s.parameter) return false;  // a subclass may answer otherwise
    uintptr_t address;
    return address_of(THPVariable_Unpack(v), address) &&
           std::find(s.storages.begin(), s.storages.end(), address) == s.storages.end();
  }
  if (level >= s.max_depth) return false;  // too deep: the walk reports it
  return holder(v, level + 1);
}

bool is_leaf(const BoundaryScan& s, PyObject* v) {
  return PyDict_GetItemWithError(s.kinds, (PyObject*)Py_TYPE(v)) == s.leaf;
}

// fence_boundary._same: `v` may stand where the map found `slot`.
bool same_slot(const BoundaryScan& s, PyObject* v, PyObject* slot) {
  if (v == slot || slot == s.any) return true;
  if (slot == s.free) {
    if (!PyTuple_CheckExact(v)) return is_leaf(s, v);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v); ++i) {
      if (!is_leaf(s, PyTuple_GET_ITEM(v, i))) return false;
    }
    return true;
  }
  if (slot != s.beyond) return false;
  PyObject* kind = PyDict_GetItemWithError(s.kinds, (PyObject*)Py_TYPE(v));
  return kind != nullptr && kind != s.tensor;
}

// fence_boundary._fresh: the same epilogue, every holder mapped holding what it held, every
// tensor over the storage it had (a buffer re-pointed in place is the same object over other memory).
bool same_state(const BoundaryScan& s, PyObject* epilogue) {
  if ((PyWeakref_CheckRef(s.owner) ? PyWeakref_GetObject(s.owner) : s.owner) != epilogue) return false;
  for (const Node& n : s.nodes) {
    size_t at = 0;
    const bool read = each_held(s, n.holder ? n.holder : epilogue, [&](PyObject* v) {
      return at < n.slots.size() && same_slot(s, v, n.slots[at++]);
    });
    if (!read || at != n.slots.size()) return false;
  }
  for (size_t i = 0; i < s.tensors.size(); ++i) {  // the storage itself, whatever a subclass would say
    uintptr_t address;
    if (!THPVariable_Check(s.tensors[i]) || !address_of(THPVariable_Unpack(s.tensors[i]), address) ||
        address != s.addresses[i]) return false;
  }
  return true;
}

const char kScanCapsule[] = "dsv41.boundary_scan";

// True only where the Python walk would find no route and say nothing; never raises.
bool scan_clean(const BoundaryScan& s, PyObject* result, PyObject* epilogue) {
  bool clean = false;
  try {
    Walk walk{s, epilogue, s.max_values};
    clean = same_state(s, epilogue) && walk.holder(result, 1);
  } catch (...) {
    clean = false;
  }
  if (PyErr_Occurred()) PyErr_Clear();  // whatever failed: unsure, never raised
  return clean;
}

PyObject* scan_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "scan(result, epilogue)");
    return nullptr;
  }
  auto* s = static_cast<BoundaryScan*>(PyCapsule_GetPointer(self, kScanCapsule));
  if (s == nullptr) return nullptr;
  if (scan_clean(*s, args[0], args[1])) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

PyMethodDef kScanMethod = {"boundary_scan", (PyCFunction)(void (*)(void))scan_call, METH_FASTCALL,
                           "scan(result, epilogue) -> True: nothing in result shares the epilogue's storages (exact), "
                           "False: unsure, run the Python walk"};

// A capsule's destructor: deletes the state it owns (its name is the one it was made with).
template <typename State>
void drop(PyObject* capsule) {
  delete static_cast<State*>(PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule)));
}

// fence_boundary.check_results with its clean step in C: wrapt calls it as
// check(wrapped, instance, args, kwargs). It calls through, reads the instance's epilogue as
// getattr(instance, name, None) does, and returns the result where there is nothing to check
// or the epilogue's bound scan (in fence_boundary's map, storages[id(epilogue)][4]) says
// clean; anything else goes to `checked(result, epilogue)`, the Python form's rest.
struct BoundaryCheck {
  PyObject* storages;  // fence_boundary._storages (owned references, all three)
  PyObject* checked;
  PyObject* name;
  ~BoundaryCheck() {
    for (PyObject* o : {storages, checked, name}) Py_XDECREF(o);
  }
};

const char kCheckCapsule[] = "dsv41.boundary_check";

// The epilogue's bound scan from the map (a new reference), or nullptr where it holds none.
PyObject* bound_scan(const BoundaryCheck& c, PyObject* epilogue) {
  PyObject* key = PyLong_FromVoidPtr(epilogue);  // id(epilogue)
  if (key == nullptr) return nullptr;
  PyObject* cached = PyDict_GetItemWithError(c.storages, key);
  Py_DECREF(key);
  if (cached == nullptr || !PyTuple_CheckExact(cached) || PyTuple_GET_SIZE(cached) != 7) return nullptr;
  PyObject* scan = PyTuple_GET_ITEM(cached, 4);
  if (!PyCFunction_Check(scan) || PyCFunction_GET_FUNCTION(scan) != (PyCFunction)(void (*)(void))scan_call) return nullptr;
  Py_INCREF(scan);  // the walk may run Python (a property) that drops it from the map
  return scan;
}

PyObject* check_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* c = static_cast<BoundaryCheck*>(PyCapsule_GetPointer(self, kCheckCapsule));
  if (c == nullptr) return nullptr;
  if (nargs != 4 || !PyTuple_Check(args[2]) || (args[3] != Py_None && !PyDict_Check(args[3]))) {
    PyErr_SetString(PyExc_TypeError, "check(wrapped, instance, args: tuple, kwargs: dict or None)");
    return nullptr;
  }
  PyObject* result = PyObject_Call(args[0], args[2], args[3] == Py_None ? nullptr : args[3]);
  if (result == nullptr) return nullptr;
  PyObject* epilogue = PyObject_GetAttr(args[1], c->name);
  if (epilogue == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
      Py_DECREF(result);
      return nullptr;  // as getattr(instance, name, None) raises it
    }
    PyErr_Clear();
    return result;
  }
  if (epilogue == Py_None || result == Py_None || result == epilogue) {
    Py_DECREF(epilogue);
    return result;
  }
  PyObject* scan = bound_scan(*c, epilogue);
  if (PyErr_Occurred()) PyErr_Clear();
  bool clean = false;
  if (scan != nullptr) {
    clean = scan_clean(*static_cast<BoundaryScan*>(PyCapsule_GetPointer(PyCFunction_GET_SELF(scan), kScanCapsule)),
                       result, epilogue);
    Py_DECREF(scan);
  }
  if (clean) {
    Py_DECREF(epilogue);
    return result;
  }
  PyObject* out = PyObject_CallFunctionObjArgs(c->checked, result, epilogue, nullptr);
  Py_DECREF(result);
  Py_DECREF(epilogue);
  return out;
}

PyMethodDef kCheckMethod = {"boundary_check", (PyCFunction)(void (*)(void))check_call, METH_FASTCALL,
                            "check(wrapped, instance, args, kwargs) -> the wrapped call's result, checked"};

// fence_forms' trusted cheap form, at each call: views_check()(cached, live, was) is True where
// each buffer the epilogue holds now (`live`) is the very object its views were cut from
// (`cached`) over the memory it had then (`was`: an alias taken when they were cut): the same
// storage address, offset, sizes, strides, dtype, device and conj/neg bits, so its views are
// still what read_accept would cut. A few integers per buffer, nothing allocated; False for
// anything else (the engine's path then runs, and proves new views).
bool same_memory(PyObject* buffer, PyObject* was) {
  if (!THPVariable_Check(buffer) || !THPVariable_Check(was)) return false;
  const at::Tensor& b = THPVariable_Unpack(buffer);
  const at::Tensor& w = THPVariable_Unpack(was);
  uintptr_t mine, then;
  return address_of(b, mine) && address_of(w, then) && mine == then && b.storage_offset() == w.storage_offset() &&
         b.dtype() == w.dtype() && b.device() == w.device() && b.is_conj() == w.is_conj() && b.is_neg() == w.is_neg() &&
         b.sizes().equals(w.sizes()) && b.strides().equals(w.strides());
}

PyObject* views_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
    Py_RETURN_FALSE;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
  if (PyTuple_GET_SIZE(args[1]) != n || PyTuple_GET_SIZE(args[2]) != n) Py_RETURN_FALSE;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* buffer = PyTuple_GET_ITEM(args[1], i);
      if (buffer != PyTuple_GET_ITEM(args[0], i) || !same_memory(buffer, PyTuple_GET_ITEM(args[2], i))) Py_RETURN_FALSE;
    }
  } catch (...) {
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyMethodDef kViewsMethod = {"views_check", (PyCFunction)(void (*)(void))views_call, METH_FASTCALL,
                            "check(cached, live, was) -> True: each live buffer is cached[i] over was[i]'s memory"};

// A C callable over a capsule that owns `state`: what boundary_scan, boundary_check and
// report_sync return.
template <typename State>
pybind11::object bound_function(State* state, const char* name, PyMethodDef* method) {
  PyObject* capsule = PyCapsule_New(state, name, drop<State>);
  if (capsule == nullptr) {
    delete state;
    throw pybind11::error_already_set();
  }
  PyObject* function = PyCFunction_New(method, capsule);
  Py_DECREF(capsule);
  if (function == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(function);
}

// tp_divergence's wrapper around SpecTpSync.sync(site, values) with its common eager call in
// C: the call the Python form (`slow`) would make with the kernel library serving, abort off,
// the site labelled, the device's counters made, a contiguous CUDA value. It reads the
// report's state from divergence's module dict, asks the engine `instance.enabled(site)`,
// broadcasts through `wrapped` (rank 0 its own value, another rank into the kept receive
// block), counts with one count_pair launch and adds the call to `_calls`; where a read is
// due or in flight, the call is a first of some kind, or the kernel declines the values,
// `after(number, slug, mine, theirs or None, settle, every)` (divergence._after_count) does
// the rest. Anything else is `slow`'s.
struct ReportSync {
  PyObject *slow, *state, *library, *after;  // owned references
  long every;
  ~ReportSync() {
    for (PyObject* o : {slow, state, library, after}) Py_XDECREF(o);
  }
};

const char kReportCapsule[] = "dsv41.report_sync";

// The attribute and state names the calls read, interned once for the process. Made first by
// report_sync() (where a failure may raise), so a call never meets an unmade one.
struct ReportNames {
  PyObject *tallies, *counts, *started, *reading, *slugs, *calls, *enabled, *group, *rank, *stopped, *kernel, *abort,
      *labels;
};

PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw pybind11::error_already_set();
  return s;
}

const ReportNames& names() {
  static const ReportNames made{interned("_tallies"), interned("counts"), interned("_started"), interned("_reading"),
                                interned("_slugs"), interned("_calls"), interned("enabled"), interned("_tp_group"),
                                interned("rank_in_group"), interned("_stopped"), interned("_kernel"), interned("_abort"),
                                interned("_labels")};
  return made;
}

// The state entry `name` (borrowed), nullptr where absent.
PyObject* state_of(const ReportSync& r, PyObject* name) {
  return PyDict_GetItemWithError(r.state, name);
}

// The device's counter tensor from divergence._tallies (keyed by device index), a new
// reference, or nullptr.
PyObject* counts_of(const ReportSync& r, int64_t device) {
  PyObject* table = state_of(r, names().tallies);
  if (table == nullptr || !PyDict_CheckExact(table)) return nullptr;
  PyObject* key = PyLong_FromLongLong(device);
  if (key == nullptr) return nullptr;
  PyObject* tally = PyDict_GetItemWithError(table, key);
  Py_DECREF(key);
  if (tally == nullptr) return nullptr;
  PyObject* tensor = PyObject_GetAttr(tally, names().counts);
  if (tensor != nullptr && !THPVariable_CheckExact(tensor)) Py_CLEAR(tensor);
  return tensor;
}

// observe's bookkeeping after a counted call: only `_calls += 1` where that is all it would
// do (not a first call, no read due or in flight); else divergence's `after` does it all.
PyObject* count_the_call(const ReportSync& r, PyObject* label, PyObject* values) {
  const ReportNames& n = names();
  PyObject* number = PyTuple_GET_ITEM(label, 0);
  PyObject* total = state_of(r, n.calls);
  PyObject* known = state_of(r, n.slugs);
  const long long next = total != nullptr && PyLong_CheckExact(total) ? PyLong_AsLongLong(total) + 1 : -1;
  if (next > 0 && next % r.every != 0 && state_of(r, n.started) == Py_True && state_of(r, n.reading) == Py_False &&
      known != nullptr && PyDict_Contains(known, number) == 1) {
    PyObject* updated = PyLong_FromLongLong(next);
    const int failed = updated == nullptr ? -1 : PyDict_SetItem(r.state, n.calls, updated);
    Py_XDECREF(updated);
    return failed ? nullptr : Py_NewRef(Py_None);
  }
  if (PyErr_Occurred()) return nullptr;
  return PyObject_CallFunction(r.after, "OOOOOl", number, PyTuple_GET_ITEM(label, 1), values, Py_None, Py_False, r.every);
}

// receive() and count_pair() for a CPython caller: a C++ exception becomes a Python one.
PyObject* receive_for(const at::Tensor& mine) {
  try {
    return THPVariable_Wrap(receive(mine));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

int count_for(const at::Tensor& mine, const at::Tensor& theirs, const at::Tensor& counts, int64_t row, bool settle) {
  try {
    return count_pair(mine, theirs, counts, row, settle) ? 1 : 0;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
}

// The call once the site is labelled and the device's counters exist, as the Python form makes it.
PyObject* counted_call(const ReportSync& r, PyObject* const* args, PyObject* label, const at::Tensor& counts) {
  const ReportNames& n = names();
  PyObject *wrapped = args[0], *instance = args[1], *site = PyTuple_GET_ITEM(args[2], 0),
           *values = PyTuple_GET_ITEM(args[2], 1);
  const at::Tensor& mine = THPVariable_Unpack(values);
  PyObject* on = PyObject_CallMethodOneArg(instance, n.enabled, site);
  const int broadcasts = on == nullptr ? -1 : PyObject_IsTrue(on);
  Py_XDECREF(on);
  if (broadcasts <= 0) return broadcasts < 0 ? nullptr : PyObject_Call(wrapped, args[2], nullptr);
  PyObject* tp_group = PyObject_GetAttr(instance, n.group);
  PyObject* rank_object = tp_group == nullptr ? nullptr : PyObject_GetAttr(tp_group, n.rank);
  Py_XDECREF(tp_group);
  const long my_rank = rank_object == nullptr ? -1 : PyLong_AsLong(rank_object);
  Py_XDECREF(rank_object);
  const int64_t number = PyLong_AsLongLong(PyTuple_GET_ITEM(label, 0));
  if (PyErr_Occurred()) return nullptr;
  const bool settle = my_rank != 0;  // rank 0 sends its own value; another receives rank 0's apart
  PyObject* sent = settle ? receive_for(mine) : Py_NewRef(values);
  if (sent == nullptr) return nullptr;
  PyObject* result = PyObject_CallFunctionObjArgs(wrapped, site, sent, nullptr);
  Py_DECREF(sent);
  if (result == nullptr) return nullptr;
  // sync is shown to return its argument: anything else, or values the kernel declines, observe counts
  const int counted = THPVariable_CheckExact(result) ? count_for(mine, THPVariable_Unpack(result), counts, number, settle) : 0;
  PyObject* done = counted < 0 ? nullptr
      : counted ? count_the_call(r, label, values)
      : PyObject_CallFunction(r.after, "OOOOOl", PyTuple_GET_ITEM(label, 0), PyTuple_GET_ITEM(label, 1), values,
                              result, settle ? Py_True : Py_False, r.every);
  if (done == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  Py_DECREF(done);
  if (!settle) return result;  // rank 0's own value, as sync returned it
  Py_DECREF(result);
  return Py_NewRef(values);  // rank 0's value, written over this rank's own
}

PyObject* report_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  const ReportNames& n = names();
  auto* r = static_cast<ReportSync*>(PyCapsule_GetPointer(self, kReportCapsule));
  if (r == nullptr) return nullptr;
  // the Python form's own reading of the call: sync(site, values), positionally
  const bool plain_call = nargs == 4 && PyTuple_CheckExact(args[2]) && PyTuple_GET_SIZE(args[2]) == 2 &&
                          (args[3] == Py_None || (PyDict_Check(args[3]) && PyDict_GET_SIZE(args[3]) == 0));
  PyObject* values = plain_call ? PyTuple_GET_ITEM(args[2], 1) : nullptr;
  if (values == nullptr || !THPVariable_CheckExact(values) || !THPVariable_Unpack(values).is_cuda() ||
      !THPVariable_Unpack(values).is_contiguous() || state_of(*r, n.stopped) != Py_None ||
      state_of(*r, n.kernel) != r->library || state_of(*r, n.abort) != Py_False) {
    return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(r->slow, args, nargs, nullptr);
  }
  PyObject* label = nullptr;
  PyObject* table = state_of(*r, n.labels);
  PyObject* key = table == nullptr ? nullptr : PyLong_FromVoidPtr(PyTuple_GET_ITEM(args[2], 0));  // id(site)
  if (key != nullptr) {
    label = PyDict_GetItemWithError(table, key);
    Py_DECREF(key);
  }
  PyObject* counts = label != nullptr && PyTuple_CheckExact(label) && PyTuple_GET_SIZE(label) == 2
      ? counts_of(*r, THPVariable_Unpack(values).get_device()) : nullptr;
  if (counts == nullptr) {  // a first call at this site or on this device: the Python form labels it, makes the counters
    return PyErr_Occurred() ? nullptr : PyObject_Vectorcall(r->slow, args, nargs, nullptr);
  }
  Py_INCREF(label);  // kept across the engine's Python, with the counters
  PyObject* out = counted_call(*r, args, label, THPVariable_Unpack(counts));
  Py_DECREF(label);
  Py_DECREF(counts);
  return out;
}

PyMethodDef kReportMethod = {"report_sync", (PyCFunction)(void (*)(void))report_call, METH_FASTCALL,
                             "around_sync(wrapped, instance, args, kwargs) -> what SpecTpSync.sync returns, counted"};
}  // namespace

pybind11::object boundary_check(pybind11::dict storages, pybind11::object checked, pybind11::str name) {
  auto* c = new BoundaryCheck{storages.inc_ref().ptr(), checked.inc_ref().ptr(), name.inc_ref().ptr()};
  return bound_function(c, kCheckCapsule, &kCheckMethod);
}

pybind11::object views_check() {
  PyObject* function = PyCFunction_New(&kViewsMethod, nullptr);
  if (function == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(function);
}

pybind11::object report_sync(pybind11::object slow, pybind11::dict state, pybind11::object library,
                             pybind11::object after, int64_t every) {
  TORCH_CHECK(every > 0, "report_sync: every must be positive");
  names();  // the names its calls read, made here where a failure may raise
  auto* r = new ReportSync{slow.inc_ref().ptr(), state.inc_ref().ptr(), library.inc_ref().ptr(), after.inc_ref().ptr(),
                           (long)every};
  return bound_function(r, kReportCapsule, &kReportMethod);
}

pybind11::object boundary_scan(pybind11::dict kinds, pybind11::dict layouts, pybind11::tuple kind_names,
                               pybind11::tuple tensor_types, pybind11::object owner, pybind11::tuple markers,
                               pybind11::list nodes, pybind11::list tensors, std::vector<uint64_t> addresses,
                               std::vector<uint64_t> storages, int64_t max_depth, int64_t max_values) {
  TORCH_CHECK(kind_names.size() == 5 && tensor_types.size() == 2 && markers.size() == 3 &&
              tensors.size() == addresses.size(), "boundary_scan: bad arguments");
  auto* s = new BoundaryScan{};
  auto own = [](pybind11::handle h) { return h.inc_ref().ptr(); };
  s->kinds = own(kinds);
  s->layouts = own(layouts);
  s->leaf = own(kind_names[0]);
  s->tensor = own(kind_names[1]);
  s->sequence = own(kind_names[2]);
  s->mapping = own(kind_names[3]);
  s->holder = own(kind_names[4]);
  s->plain_tensor = own(tensor_types[0]);
  s->parameter = own(tensor_types[1]);
  s->dict_name = PyUnicode_InternFromString("__dict__");
  s->owner = own(owner);
  s->free = own(markers[0]);
  s->beyond = own(markers[1]);
  s->any = own(markers[2]);
  for (auto node : nodes) {  // (holder or None, slots, how _fresh reads it)
    auto pair = node.cast<pybind11::tuple>();
    s->nodes.push_back(Node{pair[0].is_none() ? nullptr : own(pair[0]), {}});
    for (auto slot : pair[1].cast<pybind11::tuple>()) s->nodes.back().slots.push_back(own(slot));
  }
  for (auto t : tensors) s->tensors.push_back(own(t));
  s->addresses.assign(addresses.begin(), addresses.end());
  s->storages.assign(storages.begin(), storages.end());
  s->max_depth = (int)max_depth;
  s->max_values = (long)max_values;
  return bound_function(s, kScanCapsule, &kScanMethod);
}
"""
_SCAN_FUNCTIONS = ["boundary_scan", "boundary_check", "report_sync", "views_check"]

_CUDA_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/TensorImpl.h>
#include <map>
#include <vector>

namespace {
constexpr int kMaxFields = 8;

// Small kernel parameters: the launch copies them, so they are kept to 32-bit offsets
// (an accept result is a few thousand words at most).
struct Segments {
  const int32_t* src[kMaxFields];
  int32_t start[kMaxFields];  // first word of the field in the block
  int32_t words[kMaxFields];
  int32_t n;
  int32_t total;              // words in the block, padding included
};

__global__ void copy_segments(Segments seg, int32_t* __restrict__ dst) {
  const int32_t stride = blockDim.x * gridDim.x;
  for (int32_t w = blockIdx.x * blockDim.x + threadIdx.x; w < seg.total; w += stride) {
    #pragma unroll
    for (int i = 0; i < kMaxFields; ++i) {
      if (i < seg.n && w >= seg.start[i] && w < seg.start[i] + seg.words[i]) {
        dst[w] = seg.src[i][w - seg.start[i]];
      }
    }
  }
}

__global__ void empty_kernel() {}

std::vector<at::Tensor> clones(const std::vector<at::Tensor>& srcs) {
  std::vector<at::Tensor> out;
  out.reserve(srcs.size());
  for (const auto& t : srcs) out.push_back(t.clone());
  return out;
}
}  // namespace

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& srcs) {
  const int n = (int)srcs.size();
  if (n == 0 || n > kMaxFields) return clones(srcs);
  const auto device = srcs[0].device();
  Segments seg;
  int64_t words = 0;
  for (int i = 0; i < n; ++i) {
    const auto& t = srcs[i];
    const auto item = t.element_size();
    if (!t.is_cuda() || t.device() != device || !t.is_contiguous() || item % 4 != 0 ||
        reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 != 0 || t.requires_grad()) {
      return clones(srcs);
    }
    seg.src[i] = static_cast<const int32_t*>(t.data_ptr());
    seg.start[i] = (int32_t)words;
    seg.words[i] = (int32_t)(t.numel() * item / 4);
    words += (seg.words[i] + 3) / 4 * 4;  // next field 16-byte aligned
  }
  if (words > INT32_MAX / 2) return clones(srcs);
  seg.n = n;
  seg.total = (int32_t)words;
  // Switch devices only when the results are not on the current one (a device switch
  // costs more than the rest of this call).
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (device.index() != c10::cuda::current_device()) guard.emplace(device);
  // One block from the caching allocator, without a trip through the dispatcher: its
  // lifetime (Python references, record_stream by readers on other streams) is the
  // allocator's business.
  at::Tensor block = at::detail::empty_cuda({words > 0 ? words : 1}, at::kInt, device, c10::nullopt);
  if (words > 0) {
    const int threads = 256;
    int64_t blocks = (words + threads - 1) / threads;
    if (blocks > 1024) blocks = 1024;
    copy_segments<<<(unsigned)blocks, threads, 0, c10::cuda::getCurrentCUDAStream(device.index())>>>(
        seg, block.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (int i = 0; i < n; ++i) {
    const auto& t = srcs[i];
    // A plain (non-view) tensor of the field's dtype and shape over the shared block,
    // as set_() would make it, without a dispatcher round trip per field.
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(block.storage()), block.key_set(), t.dtype());
    impl->set_storage_offset(seg.start[i] * 4 / (int64_t)t.element_size());
    impl->set_sizes_contiguous(t.sizes());
    out.push_back(at::Tensor(std::move(impl)));
  }
  return out;
}

// --- one block for a broadcast, and the divergence report's fused comparison (spectpsync, tp_divergence)

// [block, copies...]: snapshot()'s one-launch copy, plus the whole block as one flat int32
// tensor (what one collective sends). Empty where snapshot() would clone (the caller packs
// another way): any field not contiguous, not 4-byte elements, not on one CUDA device.
std::vector<at::Tensor> pack(const std::vector<at::Tensor>& srcs) {
  if (srcs.empty() || srcs.size() > (size_t)kMaxFields) return {};
  for (const auto& t : srcs) {
    if (!t.is_cuda() || t.device() != srcs[0].device() || !t.is_contiguous() || t.element_size() % 4 != 0 ||
        reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 != 0 || t.requires_grad()) {
      return {};
    }
  }
  std::vector<at::Tensor> out = snapshot(srcs);
  const auto& storage = out[0].storage();
  for (const auto& t : out) {
    if (!t.storage().is_alias_of(storage)) return {};  // snapshot cloned (a block past its 32-bit offsets)
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage), out[0].key_set(), caffe2::TypeMeta::Make<int32_t>());
  impl->set_sizes_contiguous({(int64_t)(storage.nbytes() / 4)});
  out.insert(out.begin(), at::Tensor(std::move(impl)));
  return out;
}

namespace {
struct Pairs {
  void* mine[kMaxFields];
  const void* theirs[kMaxFields];
  int64_t numel[kMaxFields];
  int32_t item[kMaxFields];  // element size in bytes: 1, 2, 4 or 8
  int32_t n;
};

// Whether element j differs bit for bit; with `settle`, theirs then replaces mine there.
template <typename T>
__device__ __forceinline__ bool differs_at(void* a, const void* b, int64_t j, bool settle) {
  const T theirs = static_cast<const T*>(b)[j];
  if (static_cast<T*>(a)[j] == theirs) return false;
  if (settle) static_cast<T*>(a)[j] = theirs;
  return true;
}

// One block: the site's values are token-sized (a few thousand elements at most). Counts
// the elements whose bits differ, then adds [1, min(e, 1), e] to the site's counter row;
// with `settle`, each thread also writes rank 0's element over its own where they differ
// (rank 0's value received apart: one launch instead of a copy before and a compare after).
__global__ void count_differences(Pairs p, unsigned long long* __restrict__ row, bool settle) {
  __shared__ unsigned long long block_total;
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  unsigned long long local = 0;
  for (int i = 0; i < p.n; ++i) {
    void* a = p.mine[i];
    const void* b = p.theirs[i];
    for (int64_t j = threadIdx.x; j < p.numel[i]; j += blockDim.x) {
      switch (p.item[i]) {
        case 1: local += differs_at<uint8_t>(a, b, j, settle); break;
        case 2: local += differs_at<uint16_t>(a, b, j, settle); break;
        case 4: local += differs_at<uint32_t>(a, b, j, settle); break;
        default: local += differs_at<unsigned long long>(a, b, j, settle); break;
      }
    }
  }
  if (local) atomicAdd(&block_total, local);
  __syncthreads();
  if (threadIdx.x == 0) {
    // atomics: two streams may report the same site at once
    atomicAdd(row, 1ULL);
    if (block_total) {
      atomicAdd(row + 1, 1ULL);
      atomicAdd(row + 2, block_total);
    }
  }
}
}  // namespace

// One launch on the current stream (capturable) comparing every (mine, theirs) pair bit
// for bit and adding [1, min(e, 1), e] to counts[row]; with `settle`, mine then holds
// theirs. False, launching nothing, where it cannot serve (the caller compares another
// way): pairs not on counts' device, not contiguous, of other sizes, elements not
// 1/2/4/8 bytes, more than kMaxFields pairs.
bool count_divergence(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& theirs,
                      const at::Tensor& counts, int64_t row, bool settle) {
  const int n = (int)mine.size();
  if (n == 0 || n > kMaxFields || theirs.size() != mine.size() || !counts.is_cuda() ||
      counts.scalar_type() != at::kLong || !counts.is_contiguous() || counts.dim() != 2 || counts.size(1) != 3 ||
      row < 0 || row >= counts.size(0)) {
    return false;
  }
  const auto device = counts.device();
  Pairs p;
  p.n = n;
  for (int i = 0; i < n; ++i) {
    const auto& a = mine[i];
    const auto& b = theirs[i];
    const auto item = a.element_size();
    if (a.device() != device || b.device() != device || !a.is_contiguous() || !b.is_contiguous() ||
        a.numel() != b.numel() || b.element_size() != item || (item != 1 && item != 2 && item != 4 && item != 8) ||
        reinterpret_cast<uintptr_t>(a.data_ptr()) % item != 0 || reinterpret_cast<uintptr_t>(b.data_ptr()) % item != 0) {
      return false;
    }
    p.mine[i] = a.data_ptr();
    p.theirs[i] = b.data_ptr();
    p.numel[i] = a.numel();
    p.item[i] = (int32_t)item;
  }
  c10::optional<c10::cuda::CUDAGuard> guard;
  if (device.index() != c10::cuda::current_device()) guard.emplace(device);
  auto* counter = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>()) + row * 3;
  count_differences<<<1, 256, 0, c10::cuda::getCurrentCUDAStream(device.index())>>>(p, counter, settle);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

// count_divergence for one pair: no list to convert on the way in (the report's common case).
bool count_pair(const at::Tensor& mine, const at::Tensor& theirs, const at::Tensor& counts, int64_t row,
                bool settle) {
  return count_divergence({mine}, {theirs}, counts, row, settle);
}

namespace {
// An eager receive's block on one stream, and the tensor the last receive returned over it.
struct Received {
  at::Tensor block, last;
};
// (device, stream id) -> its Received. Never freed: a static tensor would be freed after the
// allocator is gone at exit. Callers hold the GIL.
std::map<std::pair<int64_t, int64_t>, Received>* receive_blocks = new std::map<std::pair<int64_t, int64_t>, Received>();
}  // namespace

// A contiguous tensor of `like`'s shape and dtype on its device, for rank 0's value to be
// received into and read by the next launch on the same stream. Eagerly one block per
// (device, stream), kept and grown as needed: a stream runs the next call's broadcast only
// after this call's read; a call like the last one on the stream (same dtype and shape)
// gets the same tensor back, no new one made. Under graph capture a fresh tensor from the
// graph's pool (a replay must not share it with eager calls).
at::Tensor receive(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), "receive: a CUDA tensor is needed");
  const auto device = like.device();
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) {
    return at::detail::empty_cuda(like.sizes(), like.scalar_type(), device, c10::nullopt);
  }
  Received& kept = (*receive_blocks)[{device.index(), stream.id()}];
  if (kept.last.defined() && kept.last.dtype() == like.dtype() && kept.last.sizes().equals(like.sizes())) {
    return kept.last;
  }
  const int64_t bytes = like.numel() * (int64_t)like.element_size();
  if (!kept.block.defined() || kept.block.numel() < bytes) {
    kept.block = at::detail::empty_cuda({bytes > 16 ? bytes : 16}, at::kByte, device, c10::nullopt);
  }
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(kept.block.storage()), kept.block.key_set(), like.dtype());
  impl->set_sizes_contiguous(like.sizes());
  kept.last = at::Tensor(std::move(impl));
  return kept.last;
}

void empty_launch() {
  empty_kernel<<<1, 1, 0, c10::cuda::getCurrentCUDAStream()>>>();
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

# The bindings' side: torch's pybind casters only, not all of torch/extension.h (a
# third of the compile time).
_CPP_SOURCE = (
    "#include <torch/csrc/utils/pybind.h>\n"
    "#include <string>\n"
    "#include <vector>\n"
    "std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& srcs);\n"
    "void empty_launch();\n"
    "std::vector<at::Tensor> pack(const std::vector<at::Tensor>& srcs);\n"
    "bool count_divergence(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& theirs, "
    "const at::Tensor& counts, int64_t row, bool settle);\n"
    "bool count_pair(const at::Tensor& mine, const at::Tensor& theirs, const at::Tensor& counts, int64_t row, "
    "bool settle);\n"
    "at::Tensor receive(const at::Tensor& like);\n"
)
_FUNCTIONS = ["snapshot", "empty_launch", "build_info", "pack", "count_divergence", "count_pair", "receive"]
# Which sources a kernel file was built from: a file from another pack version is not used.
SOURCE_HASH = hashlib.sha256((_CUDA_SOURCE + _CPP_SOURCE + _SCAN_SOURCE).encode()).hexdigest()[:16]
_ARCH = re.compile(r"(\d+)\.(\d+)([af]?)(\+PTX)?")

_mode: Optional[tuple] = None  # copy_mode()'s answer once probed
_kernel = None                 # the loaded library, when it can serve this GPU
_enabled = True                # use_extension() (tests, benchmarks)
_snapshot = None               # _kernel.snapshot while enabled: the hot path's one check


def kernel_path() -> str:
    return os.environ.get(PATH_ENV) or DEFAULT_PATH


def snapshot(tensors):
    """Fresh copies of `tensors`, queued on the current stream: one launch into one new
    block on CUDA when the kernel file serves this GPU, else clones."""
    if tensors[0].is_cuda:
        if _mode is None:
            _report(copy_mode())
        if _snapshot is not None:
            return _snapshot(tensors)
    return [t.clone() for t in tensors]


def views_current(cached, live, was) -> bool:
    """The cheap form's per-call test of its cached views (fence_forms): each buffer the
    epilogue holds now (`live`) is the very object its views were cut from (`cached`), over
    the memory it had then (`was`: an alias taken when they were cut): the same storage,
    offset, sizes, strides, dtype and neg/conj bits. A buffer re-pointed in place (set_,
    .data =, a resize_) is the same object over other memory. The kernel library's
    views_check() answers the same in C (it compares storage addresses where this compares
    storages: never more lenient); `current` is whichever serves."""
    return len(cached) == len(live) == len(was) and all(map(_same_memory, cached, live, was))


def _same_memory(cached, buffer, was) -> bool:
    try:
        return (buffer is cached and buffer.is_set_to(was) and buffer.dtype == was.dtype
                and buffer.is_neg() == was.is_neg() and buffer.is_conj() == was.is_conj())
    except Exception:  # noqa: BLE001 - no storage to compare (sparse, nested): not the same memory
        return False


current = views_current  # the cheap form's test: the kernel library's C form once it is loaded


def use_checks(library) -> None:
    """Test the cheap form's views with `library`'s C form (a loaded kernel library; tests and
    benchmarks on the CPU, where no GPU loads one), or in Python (None)."""
    global current
    current = views_current if library is None else library.views_check()


def detach(outs, fields):
    """A copy of `outs` whose `fields` (keys as holders.items names them) own their memory,
    snapshotted together on the current stream; every other field carried over and the
    copy of `outs`'s own type (holders.replaced: a subclass keeps its extra fields, a
    tuple, a keyword-only or frozen struct is no obstacle)."""
    if not fields:
        return outs
    values = dict(holders.items(outs))
    return holders.replaced(outs, dict(zip(fields, snapshot([values[key] for key in fields]))))


def _report(mode: tuple[str, str]) -> None:
    # Probed at the first CUDA result, on the rank's own device (a probe at start-up would
    # open a CUDA context on device 0 in every rank): one line says which copy serves.
    log.emit(f"folded_fence copy: {mode[0]} - {mode[1]}", adapter="folded_fence", copy=mode[0], detail=mode[1])
    metrics.copy_mode(mode[0])


def copy_mode() -> tuple[str, str]:
    """("one-launch", the kernel file it loaded) or ("clones", why). The first call
    loads the file (a dlopen, no compile, no GPU work beyond a capability query)."""
    global _mode, _kernel
    if _mode is None:
        _mode, _kernel = _probe(kernel_path(), _capability())
        use_extension(_enabled)
        if _kernel is not None:
            use_checks(_kernel)
    if _kernel is not None and not _enabled:
        return ("clones", "switched off by use_extension(False)")
    return _mode


def expected_mode() -> tuple[str, str]:
    """What copy_mode() will answer in a rank, told without touching CUDA (doctor, the
    per-rank line at start-up): the GPUs' compute capability from NVML, the kernel file
    loaded but not run. Every GPU of the machine must be served for "one-launch"."""
    capabilities = nvml_capabilities()
    if not capabilities:
        return _probe(kernel_path(), None)[0]
    modes = {_probe(kernel_path(), capability)[0] for capability in sorted(set(capabilities))}
    return modes.pop() if len(modes) == 1 else ("clones", "on some GPUs: " + "; ".join(sorted(m[1] for m in modes if m[0] == "clones")))


def nvml_capabilities() -> list:
    """(major, minor) of every GPU NVML sees, [] without a driver. NVML opens no CUDA
    context (torch.cuda would, on device 0, in whichever process asks)."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    count, found = ctypes.c_uint(), []
    if nvml.nvmlInit_v2() != 0:
        return []
    try:
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) == 0
                    and nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0):
                found.append((major.value, minor.value))
    finally:
        nvml.nvmlShutdown()
    return found


def extension():
    """The loaded kernel library (for benchmarks: `empty_launch` is the yardstick), or None."""
    copy_mode()
    return _kernel


def probed_extension():
    """The loaded kernel library, or None, probed as at the fence's first CUDA result and
    said in the same one line (fence_boundary's native scan, at its first check on a GPU)."""
    if _mode is None:
        _report(copy_mode())
    return _kernel


def _offered():
    """(the library or None, its file or why not), for the shared decode-path code."""
    kernel = extension()
    return kernel, (kernel_path() if kernel is not None else copy_mode()[1])


shared_library.offer(_offered)  # the broadcast's block and the divergence report's comparison: one launch each


def use_extension(enabled: bool) -> None:
    """Switch the fast path on or off (tests and benchmarks compare both); off means clones."""
    global _enabled, _snapshot
    _enabled = bool(enabled)
    _snapshot = _kernel.snapshot if (_kernel is not None and _enabled) else None


def _capability() -> Optional[tuple]:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def runs_on(capability: tuple, archs: str) -> bool:
    """Whether code built for `archs` (TORCH_CUDA_ARCH_LIST entries) runs on a GPU of
    `capability`: machine code for X.Y runs on X.Z with Z >= Y (X.Ya on X.Y only),
    +PTX on any later GPU (the driver compiles it)."""
    for arch in archs.split():
        m = _ARCH.fullmatch(arch)
        if not m:
            continue
        built = (int(m[1]), int(m[2]))
        if m[4] and m[3] != "a" and tuple(capability) >= built:
            return True
        if capability[0] == built[0] and (capability[1] == built[1] if m[3] == "a" else capability[1] >= built[1]):
            return True
    return False


def _info(kernel) -> dict:
    return dict(part.partition("=")[::2] for part in kernel.build_info().split(";"))


def load(path: str):
    """Load the kernel file with Python's extension loader, by path; check that it was
    built from these sources against this torch. Returns (module, its arch list)."""
    import importlib.machinery
    import importlib.util

    import torch  # the library links against the libraries torch has loaded

    loader = importlib.machinery.ExtensionFileLoader(MODULE, path)
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    kernel = importlib.util.module_from_spec(spec)
    loader.exec_module(kernel)
    info = _info(kernel)
    if info.get("source") != SOURCE_HASH:
        raise ImportError(f"built from other sources ({info.get('source')}; this pack's: {SOURCE_HASH})")
    if info.get("torch") != torch.__version__:
        raise ImportError(f"built against torch {info.get('torch')}, this is torch {torch.__version__}")
    return kernel, info.get("archs", "")


def _probe(path: str, capability: Optional[tuple]):
    """((mode, detail), loaded library or None) for a GPU of `capability` (None: no CUDA)."""
    if capability is None:
        return ("clones", "no CUDA"), None
    if not os.path.isfile(path):
        return ("clones", f"kernel not built ({path} missing)"), None
    try:
        kernel, archs = load(path)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the clones in place
        return ("clones", f"load error: {path}: {type(exc).__name__}: {str(exc).strip()[-300:]}"), None
    if not runs_on(capability, archs):
        return ("clones", f"arch sm_{capability[0]}{capability[1]} not in the build ({archs})"), None
    return ("one-launch", path), kernel


# --- the build (image build time; needs nvcc, no GPU) -------------------------------------

def _arch_list(archs: str) -> str:
    items = archs.replace(";", " ").split()
    bad = [a for a in items if not _ARCH.fullmatch(a)]
    if not items or bad:
        raise ValueError(f"--archs {archs!r}: expected entries like 9.0, 10.0, 9.0a, 9.0+PTX")
    return " ".join(items)


def build(out: str, archs: str = DEFAULT_ARCHS, verbose: bool = False) -> str:
    """Compile the kernel library for `archs`, check it loads in a fresh interpreter,
    and move it to `out`. Raises on any failure; `out` is only written on success."""
    import torch
    from torch.utils import cpp_extension

    archs = _arch_list(archs)
    nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
    if not cpp_extension.CUDA_HOME or not os.access(nvcc, os.X_OK):
        raise RuntimeError(f"no CUDA compiler (CUDA_HOME={cpp_extension.CUDA_HOME!r}, no {nvcc})")
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is built without CUDA")
    info = f"archs={archs};source={SOURCE_HASH};torch={torch.__version__}"
    cpp = _CPP_SOURCE + _SCAN_SOURCE + f'std::string build_info() {{ return "{info}"; }}\n'
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # torch's way to name the targets
    # Our own includes only, where this torch allows it (faster; same code either way).
    light = "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    staged = f"{out}.{os.getpid()}.tmp"  # beside `out`: os.replace does not cross file systems
    try:
        with tempfile.TemporaryDirectory(prefix="accept-snapshot-") as tmp:
            cpp_extension.load_inline(
                name=MODULE, cpp_sources=cpp, cuda_sources=_CUDA_SOURCE, functions=_FUNCTIONS + _SCAN_FUNCTIONS,
                extra_cflags=["-O2"], extra_cuda_cflags=["-O2"], build_directory=tmp,
                with_pytorch_error_handling=False, verbose=verbose, **({"no_implicit_headers": True} if light else {}),
            )
            shutil.copyfile(os.path.join(tmp, f"{MODULE}.so"), staged)
        # Loaded as a rank will load it: a fresh interpreter, by path, no build folder.
        check = subprocess.run(
            [sys.executable, "-P", "-c", f"from sglang_dsv41_adapters.folded_fence.accept_snapshot import load; print(load({staged!r})[1])"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": _pack_root()},
        )
        if check.returncode != 0 or check.stdout.strip() != archs:
            raise RuntimeError(f"the built kernel does not load: {(check.stdout + check.stderr).strip()[-1500:]}")
        os.chmod(staged, 0o644)
        os.replace(staged, out)
    finally:
        if os.path.exists(staged):
            os.remove(staged)
    return out


def _pack_root() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -P -m sglang_dsv41_adapters.folded_fence.accept_snapshot", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the kernel file (image build time)")
    b.add_argument("--archs", default=DEFAULT_ARCHS, help=f"TORCH_CUDA_ARCH_LIST entries (default {DEFAULT_ARCHS!r})")
    b.add_argument("--out", default=None, help=f"where to put it (default ${PATH_ENV}, else {DEFAULT_PATH})")
    b.add_argument("--allow-clones", default="0",
                   help="1: a failed build is not an error, the fence will use clones; 0 (default): it fails")
    b.add_argument("--verbose", action="store_true")
    sub.add_parser("mode", help="print copy_mode() for this process")
    args = parser.parse_args(argv)
    if args.command == "mode":
        print(*copy_mode(), sep=": ")
        return 0
    if args.allow_clones not in ("0", "1"):
        print(f"accept_snapshot build: --allow-clones (ALLOW_CLONE_FENCE) must be 0 or 1, not {args.allow_clones!r}",
              file=sys.stderr)
        return 2
    out = args.out or kernel_path()
    try:
        print(f"accept_snapshot: built {build(out, args.archs, args.verbose)} for {_arch_list(args.archs)}")
        return 0
    except Exception as exc:  # noqa: BLE001 - reported, then the allow rule decides
        reason = f"{type(exc).__name__}: {str(exc).strip()[-3000:]}"
    if args.allow_clones == "1":
        print(f"accept_snapshot: NOT BUILT, the fence will use clones (allowed by ALLOW_CLONE_FENCE=1): {reason}",
              file=sys.stderr)
        return 0
    print(f"accept_snapshot: the kernel did not build or load: {reason}\n"
          "Fix the build, or build with --build-arg ALLOW_CLONE_FENCE=1 to ship an image whose fence uses clones.",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
