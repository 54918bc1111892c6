// The library's host side: its Python module, and C forms of the pack's Python checks (no CUDA).
//
// Compiled with accept_snapshot.cu into one library (folded_fence/accept_snapshot.py), with torch's
// pybind casters only, not all of torch/extension.h (a third of the compile time). Besides binding
// the CUDA side, it holds host-side C++ over the CPython API:
// - the boundary check's native scan (fence_boundary): `boundary_scan(...)` binds the walk's tables
//   and one epilogue's memory map, and returns a plain CPython callable `scan(result, epilogue)`:
//   True only where the map still holds (fence_boundary._fresh) and fence_boundary's Python walk
//   would find no route and report nothing; False (unsure) for anything it does not read exactly as
//   that walk does, which then runs the walk;
// - `boundary_check(...)`: fence_boundary.check_results in C over those scans (and its copy of a
//   find whose keys a Python copy found), and `boundary_method(...)`: the worker's method with
//   that check in it, which the class holds in place of wrapt's binding once the check serves;
// - `report_sync(...)`: tp_divergence's wrapper of SpecTpSync.sync in C (its common eager call);
// - `views_check()`: the cheap form's per-call test of its cached views (views_current), and
//   `fenced_method(...)`: accept_and_finalize with the cheap form's trusted call in it, which the
//   class holds in place of wrapt's binding once a batch size is trusted.
// Each hands its Python form what it does not do itself.
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/autograd/python_variable.h>
#include <c10/core/impl/COW.h>
#include <structmember.h>
#include <algorithm>
#include <utility>
#include <cstdint>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

// accept_snapshot.cu
std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& srcs);
void empty_launch();
std::vector<at::Tensor> pack(const std::vector<at::Tensor>& srcs);
bool count_divergence(const std::vector<at::Tensor>& mine, const std::vector<at::Tensor>& theirs,
                      const at::Tensor& counts, int64_t row, bool settle);
bool count_pair(const at::Tensor& mine, const at::Tensor& theirs, const at::Tensor& counts, int64_t row,
                bool settle);
at::Tensor receive(const at::Tensor& like);
at::Tensor dense_copy(const at::Tensor& t);
// Written by the build: "archs=...;source=...;torch=..." (the loader checks it).
std::string build_info();

namespace {
// One holder of the epilogue's memory as fence_boundary._map walked it.
struct Node {
  PyObject* holder;              // nullptr: the epilogue itself
  std::vector<PyObject*> slots;  // the values it held, or the free / beyond markers (owned references)
  // A holder read from its instance slots alone (a msgspec struct, a slotted class): the type and
  // version tag it had when found so, and the slots' offsets; compared in place while both hold.
  mutable PyTypeObject* slots_type = nullptr;
  mutable unsigned int slots_tag = 0;
  mutable const std::vector<Py_ssize_t>* offsets = nullptr;
};

// How a holder type's layout names read: the instance slots a getattr of each would return,
// valid while the type's version tag is `tag` (any change to the type or a base gives it a new one).
struct SlotReads {
  unsigned int tag = 0;
  bool direct = false;             // false: each name read by getattr
  std::vector<Py_ssize_t> offsets;
};

struct BoundaryScan {
  mutable std::unordered_map<PyTypeObject*, SlotReads> slot_reads;  // keyed by type, checked by tag
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
  // What each of those tensors was over when bound: its TensorImpl, that impl's StorageImpl and
  // the storage's deleter (nullptr impl: not read in place, e.g. a copy-on-write storage)
  std::vector<const c10::TensorImpl*> impls;
  std::vector<const c10::StorageImpl*> storage_impls;
  std::vector<c10::DeleterFnPtr> deleters;
  mutable std::vector<std::tuple<PyTypeObject*, unsigned int, bool>> plain_types;  // plain_type's, by version tag
  mutable uint64_t kinds_version = 0;  // kind_of's: KINDS's version, and the types met at it
  mutable std::vector<std::pair<PyTypeObject*, PyObject*>> kinds_met;
  std::vector<size_t> distinct_storages;  // the first tensor over each distinct StorageImpl
  std::vector<uintptr_t> storages;  // the map's storages
  // fence_boundary._left: the result's type, its logits output's type, the attribute holding that
  // output and the output's logits field; a tensor found there is left in place (nullptr: none is)
  PyObject *leave_result = nullptr, *leave_logits = nullptr, *leave_holder = nullptr, *leave_field = nullptr;
  // same_state as flat reads, compiled from a full pass that held (compile_state); empty: none
  mutable struct Compiled {
    bool ready = false;
    std::vector<std::pair<PyObject*, PyTypeObject*>> types;         // a holder read by its slots, its type then
    std::vector<std::pair<PyTypeObject*, unsigned int>> tags;       // each such type, its version tag then
    std::vector<PyObject**> at;                                      // each slot of those holders ...
    std::vector<PyObject*> was;                                      // ... and what it held (nullptr: unset)
    std::vector<std::pair<PyObject**, PyObject*>> marked;           // a slot the map marked free/beyond/any
    std::vector<std::pair<PyObject*, uint64_t>> dicts;              // a dict the map read, its version then
    struct Vars {                                                    // a holder read by vars(h) alone:
      PyObject* holder;                                              // (nullptr: the epilogue)
      PyTypeObject* type;                                            // its type, its __dict__ and that
      PyObject* dict;                                                // dict's version then
      uint64_t version;
      unsigned int plain_tag;                                        // a plain type's tag then (0: not plain)
    };
    std::vector<Vars> vars;
    std::vector<std::pair<PyObject*, PyObject*>> kept;              // a value of those dicts the map marked free or
                                                                     // beyond, and the marker: judged again each time
    std::vector<size_t> read;                                        // the nodes read as each_held reads them
  } compiled;
  int max_depth;
  long max_values;
  ~BoundaryScan() {
    for (PyObject* o : {kinds, layouts, leaf, tensor, sequence, mapping, holder, plain_tensor, parameter, dict_name,
                        owner, free, beyond, any, leave_result, leave_logits, leave_holder, leave_field}) Py_XDECREF(o);
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

// A dict's version (PEP 509): a new one, from one counter for the process, at its making and at
// each change; 0 where this Python keeps none (3.14 dropped it), and the dict is read in full.
uint64_t version_of(PyObject* d) {
#if PY_VERSION_HEX < 0x030E0000
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return reinterpret_cast<PyDictObject*>(d)->ma_version_tag;
#pragma GCC diagnostic pop
#else
  return 0;
#endif
}

// A class made here for a probe: type(name, (), attributes), a new reference (nullptr where it failed).
PyObject* probe_class(const char* name, PyObject* attributes) {
  return attributes ? PyObject_CallFunction((PyObject*)&PyType_Type, "s()O", name, attributes) : nullptr;
}

// Whether this Python gives a dict a new version at every change the compiled test relies on, tried
// once: an item of a dict set, replaced and deleted, and an attribute of an instance whose __dict__
// was read stored, replaced and deleted through the instance (a path of its own in some releases).
bool versions_kept() {
  static const bool kept = [] {
    bool changed = true;
    PyObject* attributes = PyDict_New();
    PyObject* probe = probe_class("VersionProbe", attributes);
    PyObject* instance = probe ? PyObject_CallNoArgs(probe) : nullptr;
    PyObject* d = instance ? PyObject_GetAttrString(instance, "__dict__") : nullptr;
    PyObject* plain = PyDict_New();
    PyObject *one = PyLong_FromLong(1), *two = PyLong_FromLong(2);
    if (d == nullptr || plain == nullptr || !PyDict_CheckExact(d) || version_of(d) == 0) changed = false;
    auto step = [&](PyObject* dict, auto&& change) {
      const uint64_t before = version_of(dict);
      changed = changed && change() == 0 && version_of(dict) != before;
    };
    step(plain, [&] { return PyDict_SetItemString(plain, "a", one); });
    step(plain, [&] { return PyDict_SetItemString(plain, "a", two); });
    step(plain, [&] { return PyDict_DelItemString(plain, "a"); });
    if (changed) {
      step(d, [&] { return PyObject_SetAttrString(instance, "a", one); });
      step(d, [&] { return PyObject_SetAttrString(instance, "a", two); });
      step(d, [&] { return PyObject_DelAttrString(instance, "a"); });
    }
    for (PyObject* o : {attributes, probe, instance, d, plain, one, two}) Py_XDECREF(o);
    if (PyErr_Occurred()) PyErr_Clear();
    return changed;
  }();
  return kept;
}

// KINDS[tp] (borrowed), or nullptr (an error set where the lookup raised), as PyDict_GetItemWithError
// answers; the types met are kept beside it while KINDS's version is the one they were met at
// (KINDS owns its types and kinds, so none of them is freed meanwhile). A walk asks it per value.
PyObject* kind_of(const BoundaryScan& s, PyTypeObject* tp) {
  const uint64_t version = versions_kept() ? version_of(s.kinds) : 0;
  if (version == 0 || version != s.kinds_version) {
    s.kinds_met.clear();
    s.kinds_version = version;
  }
  for (const auto& [met, kind] : s.kinds_met) {
    if (met == tp) return kind;
  }
  PyObject* kind = PyDict_GetItemWithError(s.kinds, (PyObject*)tp);
  if (kind != nullptr && version != 0 && s.kinds_met.size() < 64) s.kinds_met.emplace_back(tp, kind);
  return kind;
}

// f(v) with `v` (a borrowed reference) kept alive around the call: f may run Python that drops it.
template <typename F>
bool handed(PyObject* v, F&& f) {
  Py_INCREF(v);
  const bool answer = f(v);
  Py_DECREF(v);
  return answer;
}

// Each item a list or tuple `h` stores, then each value a dict `d` stores, handed to `f` (kept
// alive around the call; its false stops the reading and is returned).
template <typename F>
bool each_item(PyObject* h, F&& f) {
  const bool list = PyList_Check(h);
  for (Py_ssize_t i = 0; i < (list ? PyList_GET_SIZE(h) : PyTuple_GET_SIZE(h)); ++i) {
    if (!handed(list ? PyList_GET_ITEM(h, i) : PyTuple_GET_ITEM(h, i), f)) return false;
  }
  return true;
}

template <typename F>
bool each_stored(PyObject* d, F&& f) {
  const Py_ssize_t size = PyDict_GET_SIZE(d);
  Py_ssize_t at = 0;
  PyObject *key, *v;
  while (PyDict_Next(d, &at, &key, &v)) {
    if (!handed(v, f) || PyDict_GET_SIZE(d) != size) return false;
  }
  return true;
}

// The slot offsets of `names` where getattr(h, name) of an instance of `tp` is a plain read of
// the instance's slot: the generic getattr, and each name a member descriptor of an object slot
// (msgspec struct fields and __slots__ are); nullptr where any is not, and getattr serves. A
// struct's fields read this way cost a load each instead of a lookup and a call, on every step.
const std::vector<Py_ssize_t>* slot_offsets(const BoundaryScan& s, PyTypeObject* tp, PyObject* names) {
  if (tp->tp_getattro != PyObject_GenericGetAttr || PyTuple_GET_SIZE(names) == 0) return nullptr;
  SlotReads& reads = s.slot_reads[tp];
  if (reads.tag == 0 || reads.tag != tp->tp_version_tag) {
    reads = SlotReads{};
    bool direct = true;
    for (Py_ssize_t i = 0; direct && i < PyTuple_GET_SIZE(names); ++i) {
      PyObject* found = _PyType_Lookup(tp, PyTuple_GET_ITEM(names, i));  // borrowed; sets the tag
      const PyMemberDef* member = found != nullptr && Py_TYPE(found) == &PyMemberDescr_Type
          ? reinterpret_cast<PyMemberDescrObject*>(found)->d_member : nullptr;
      direct = member != nullptr && member->type == T_OBJECT_EX && !(member->flags & PY_AUDIT_READ);
      if (direct) reads.offsets.push_back(member->offset);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    reads.tag = tp->tp_version_tag;  // after the lookups, which give the type one where it had none
    reads.direct = direct && reads.tag != 0;
  }
  return reads.direct ? &reads.offsets : nullptr;
}

// What getattr(h, name, _UNSET) returns for each name whose slot is at `offsets`, read from the
// slot, handed to `f` (kept alive around the call; its false stops the reading and is returned);
// an unset slot is skipped, as getattr raises AttributeError there and the walk skips it.
template <typename F>
bool each_in_slots(PyObject* h, const std::vector<Py_ssize_t>& offsets, F&& f) {
  for (Py_ssize_t offset : offsets) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(h) + offset);
    if (v != nullptr && !handed(v, f)) return false;
  }
  return true;
}

// holders._layouts[tp] (for a type KINDS has as a holder): the names it stores outside __dict__ (a
// tuple, borrowed) and whether it has a __dict__; false (no error left) where it has none of that shape.
bool holder_layout(const BoundaryScan& s, PyTypeObject* tp, PyObject*& names, bool& has_dict) {
  PyObject* layout = PyDict_GetItemWithError(s.layouts, (PyObject*)tp);
  if (layout == nullptr || !PyTuple_CheckExact(layout) || PyTuple_GET_SIZE(layout) != 2 ||
      !PyTuple_CheckExact(PyTuple_GET_ITEM(layout, 0)) || !PyBool_Check(PyTuple_GET_ITEM(layout, 1))) {
    if (PyErr_Occurred()) PyErr_Clear();
    return false;
  }
  names = PyTuple_GET_ITEM(layout, 0);
  has_dict = PyTuple_GET_ITEM(layout, 1) == Py_True;
  return true;
}

// Reading an instance's attributes without making its __dict__.
//
// CPython (3.11+) keeps a plain instance's attributes inline and makes its __dict__ only when
// something asks for it, once per object; vars(h) asks. A result built anew at each step would
// pay that at each check, and again when it is freed. A plain instance is read here as the
// garbage collector reads it: its type's tp_traverse visits exactly the values vars(h) would
// hold (in another order), then the type. Plain: __dict__ the generic managed one (no
// __slots__, no base with fields of its own, attribute lookup and the __dict__ descriptor
// CPython's own); every other instance is read through vars(h) as before. Whether the running
// Python does that as read here is tried once per process (plain_reads).
#if PY_VERSION_HEX >= 0x030B0000 && !defined(Py_GIL_DISABLED)
// The __dict__ CPython made for `h`, an instance of a managed-dict type, or nullptr where none is
// made yet (the word before the object's header: 3.12 tags it where it points to inline values).
PyObject* made_dict(PyObject* h) {
  const uintptr_t word = reinterpret_cast<const uintptr_t*>(h)[-3];
#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030D0000
  if (word & 1) return nullptr;
#endif
  return reinterpret_cast<PyObject*>(word);
}
#else
PyObject* made_dict(PyObject*) { return nullptr; }
#endif

// What tp_traverse visits of an object, up to 64 (borrowed references: nothing runs meanwhile).
struct Visited {
  PyObject* at[64];
  int count = 0;
  bool operator==(const Visited& o) const { return count == o.count && std::equal(at, at + count, o.at); }
};

int visited(PyObject* v, void* into) {
  auto* seen = static_cast<Visited*>(into);
  if (seen->count == 64) return -1;  // stops the traversal: read otherwise
  seen->at[seen->count++] = v;
  return 0;
}

bool traversed(PyObject* h, Visited& seen) {
  seen.count = 0;
  return Py_TYPE(h)->tp_traverse(h, visited, &seen) == 0;
}

// Calls the scan makes that may run Python (a getattr: a property, a __getattr__), counted: a
// value read before one may no longer be held.
uint64_t python_calls = 0;

// The generic implementations a plain instance's type carries, read from a class made here.
struct PlainReads {
  bool works = false;        // this Python reads a plain instance as read here
  traverseproc traverse;     // its tp_traverse
  getattrofunc hooked;       // tp_getattro of a class with __getattr__ (tried after the generic lookup)
  getter dict_get;           // its __dict__ descriptor's getter
  PyObject* getattribute;    // object.__getattribute__
};

PyObject* type_entry(PyTypeObject* tp, const char* name) {  // _PyType_Lookup by a C string, borrowed
  PyObject* key = PyUnicode_InternFromString(name);
  PyObject* found = key ? _PyType_Lookup(tp, key) : nullptr;
  Py_XDECREF(key);
  return found;
}

getter dict_getter(PyTypeObject* tp) {
  PyObject* found = type_entry(tp, "__dict__");
  return found != nullptr && Py_TYPE(found) == &PyGetSetDescr_Type
      ? reinterpret_cast<PyGetSetDescrObject*>(found)->d_getset->get : nullptr;
}

// Tried once: an instance of a class made here, given two attributes, is visited as those two
// values then its class, with no __dict__ made; once vars() made one, that is the dict found.
const PlainReads& plain_reads() {
  static const PlainReads reads = [] {
    PlainReads r{};
#if PY_VERSION_HEX >= 0x030B0000 && !defined(Py_GIL_DISABLED)
    PyObject* attributes = PyDict_New();
    PyObject* plain = probe_class("PlainProbe", attributes);
    PyObject* hooks = PyDict_New();
    PyObject* getattr_fn = hooks ? PyRun_String("lambda self, name: None", Py_eval_input, hooks, hooks) : nullptr;
    if (getattr_fn != nullptr) PyDict_SetItemString(hooks, "__getattr__", getattr_fn);
    PyObject* hooked = getattr_fn ? probe_class("HookedProbe", hooks) : nullptr;
    PyObject* h = plain ? PyObject_CallNoArgs(plain) : nullptr;
    PyObject *one = PyLong_FromLong(1001), *two = PyFloat_FromDouble(2.5);
    if (h != nullptr && hooked != nullptr && one != nullptr && two != nullptr &&
        (Py_TYPE(h)->tp_flags & Py_TPFLAGS_MANAGED_DICT) && PyObject_SetAttrString(h, "a", one) == 0 &&
        PyObject_SetAttrString(h, "b", two) == 0 && made_dict(h) == nullptr) {
      Visited seen;
      bool found = traversed(h, seen) && seen.count == 3 && seen.at[2] == plain &&
                   ((seen.at[0] == one && seen.at[1] == two) || (seen.at[0] == two && seen.at[1] == one));
      PyObject* d = found ? PyObject_GetAttrString(h, "__dict__") : nullptr;
      found = found && d != nullptr && made_dict(h) == d && PyDict_CheckExact(d) && PyDict_GET_SIZE(d) == 2;
      Py_XDECREF(d);
      r.traverse = Py_TYPE(h)->tp_traverse;
      r.hooked = reinterpret_cast<PyTypeObject*>(hooked)->tp_getattro;
      r.dict_get = dict_getter(Py_TYPE(h));
      r.getattribute = type_entry(&PyBaseObject_Type, "__getattribute__");
      r.works = found && r.traverse != nullptr && r.dict_get != nullptr && r.getattribute != nullptr &&
                r.hooked != PyObject_GenericGetAttr;
    }
    for (PyObject* o : {attributes, plain, hooks, getattr_fn, hooked, h, one, two}) Py_XDECREF(o);
    if (PyErr_Occurred()) PyErr_Clear();
#endif
    return r;
  }();
  return reads;
}

// What the scan's self-checks (each tried once per process) found of the running Python: whether
// it reads a plain instance as read here (tp_traverse, the managed __dict__ word), and whether a
// dict's version (PEP 509) changes at every change the compiled test relies on (not on 3.13, where
// an attribute stored through an instance leaves its made __dict__'s version as it was; none from
// 3.14): where it does not, dicts are read in full. A Python whose plain instances read otherwise
// may differ in what the checks do not try too, so fence_boundary leaves its checks to the walk.
pybind11::dict layout() {
  pybind11::dict found;
  found["plain_reads"] = plain_reads().works;
  found["dict_versions"] = versions_kept();
  return found;
}

// Whether instances of `tp` are plain (read by made_dict and tp_traverse as vars(h) reads them),
// kept per type while its version tag holds (a class changed later gets a new one).
bool plain_type(const BoundaryScan& s, PyTypeObject* tp) {
  const PlainReads& r = plain_reads();
  if (!r.works || !(tp->tp_flags & Py_TPFLAGS_MANAGED_DICT)) return false;
  for (const auto& [type, tag, plain] : s.plain_types) {
    if (type == tp && tag == tp->tp_version_tag) return plain;
  }
  bool plain = tp->tp_traverse == r.traverse && dict_getter(tp) == r.dict_get &&
               (tp->tp_getattro == PyObject_GenericGetAttr ||
                (tp->tp_getattro == r.hooked && type_entry(tp, "__getattribute__") == r.getattribute));
  PyTypeObject* base = tp;
  for (; plain && base != &PyBaseObject_Type; base = base->tp_base) {  // subtype_traverse's own walk up
    plain = base != nullptr && base->tp_traverse == r.traverse && Py_SIZE(base) == 0;
  }
  if (PyErr_Occurred()) PyErr_Clear();
  const unsigned int tag = tp->tp_version_tag;  // after the lookups, which give the type one where it had none
  if (tag == 0) return false;
  if (s.plain_types.size() >= 64) s.plain_types.clear();
  s.plain_types.emplace_back(tp, tag, plain);
  return plain;
}

// vars(h)'s values, each handed to `f` (kept alive around the call; its false stops the reading),
// in the dict's order or, for a plain instance with no __dict__ made yet, in the order its
// type visits them (where the order does not matter); false also where h changed meanwhile.
template <typename F>
bool each_attribute(const BoundaryScan& s, PyObject* h, F&& f, bool any_order) {
  PyTypeObject* tp = Py_TYPE(h);
  // vars(h)'s values as the type visits them: all it visits but the type, last (false: not so now)
  auto values_of = [&](Visited& seen) {
    if (!traversed(h, seen) || Py_TYPE(h) != tp || made_dict(h) != nullptr || seen.count == 0 ||
        seen.at[seen.count - 1] != (PyObject*)tp) return false;
    --seen.count;
    return true;
  };
  Visited seen;
  if (any_order && plain_type(s, tp) && made_dict(h) == nullptr && values_of(seen)) {  // made_dict: a managed type's word
    uint64_t calls = python_calls;
    auto holds_what_was_read = [&] {  // where Python ran since: h still holds it (which keeps it alive)
      if (python_calls == calls) return true;
      calls = python_calls;
      Visited now;
      return values_of(now) && now == seen;
    };
    for (int i = 0; i < seen.count; ++i) {
      if (!holds_what_was_read() || !handed(seen.at[i], f)) return false;
    }
    return holds_what_was_read();
  }
  ++python_calls;
  PyObject* d = PyObject_GetAttr(h, s.dict_name);  // vars(h)
  if (d == nullptr) return false;
  const bool done = PyDict_CheckExact(d) && each_stored(d, f);
  Py_DECREF(d);
  return done;
}

// holders.items(h)'s values, in its order, each handed to `f` (its false stops the reading); false
// also where h is not read here exactly as holders.items reads it.
template <typename F>
bool each_value(const BoundaryScan& s, PyObject* h, F&& f, bool any_order = false) {
  PyTypeObject* tp = Py_TYPE(h);
  PyObject* kind = kind_of(s, tp);
  if (kind == nullptr) return false;
  if (kind == s.leaf || kind == s.tensor) return true;  // items() gives nothing
  if (kind == s.sequence) {  // enumerate(h): the base type's own iterator only
    const bool list = PyList_Check(h) && tp->tp_iter == PyList_Type.tp_iter;
    if (!list && !(PyTuple_Check(h) && tp->tp_iter == PyTuple_Type.tp_iter)) return false;
    return each_item(h, f);
  }
  if (kind == s.mapping) return PyDict_CheckExact(h) && each_stored(h, f);  // a subclass may read otherwise
  PyObject* names;
  bool has_dict;
  if (kind != s.holder || !holder_layout(s, tp, names, has_dict)) return false;
  if (const std::vector<Py_ssize_t>* offsets = slot_offsets(s, tp, names)) {
    if (!each_in_slots(h, *offsets, f)) return false;
  } else {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); ++i) {  // getattr(h, name, _UNSET)
      ++python_calls;
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
  }
  if (PyTuple_GET_SIZE(names) != 0 && !has_dict) return true;
  return each_attribute(s, h, f, any_order);
}

// The slot offsets each_value reads `h` by where that is all it reads (a holder whose layout has
// no __dict__, read from its slots: not a list, tuple or dict), else nullptr.
const std::vector<Py_ssize_t>* slots_only(const BoundaryScan& s, PyObject* h) {
  if (PyList_Check(h) || PyTuple_Check(h) || PyDict_Check(h)) return nullptr;
  PyObject* names;
  bool has_dict;
  if (kind_of(s, Py_TYPE(h)) != s.holder || !holder_layout(s, Py_TYPE(h), names, has_dict) || has_dict) {
    if (PyErr_Occurred()) PyErr_Clear();
    return nullptr;
  }
  return slot_offsets(s, Py_TYPE(h), names);
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

bool reads_at(PyObject* holder, PyObject* key, PyObject* expected);

struct Walk {
  const BoundaryScan& s;
  PyObject* epilogue;
  long left;
  // Each tensor over the map's storages as the walk finds it (the Python walk copies it and
  // names its route): (the holders from the result down to the one keeping it, the tensor, its
  // storage's address), in a list made at the first.
  PyObject* shared = nullptr;
  PyObject* path[16];  // the holders being read, the result first (alive: each is handed)
  int depth = 0;
  bool value(PyObject* v, int level);
  bool holder(PyObject* h, int level) {  // the order values are judged in does not change the answer
    if (depth == 16) return false;
    path[depth++] = h;
    const bool read = each_value(s, h, [&](PyObject* v) { return value(v, level); }, true);
    --depth;
    return read;
  }
  bool found_shared(PyObject* tensor, uintptr_t address);
  bool left_in_place(PyObject* tensor) const;
};

// fence_boundary._left: `tensor` is the result's logits_output.next_token_logits, the result and the
// output of the types logits_readers showed nothing reads them through after the worker returns, the
// output held by the result under that attribute alone (the walk knows the key it came by; this, only
// the holders: held under another attribute too, it is read there unproven, and the walk copies it).
bool Walk::left_in_place(PyObject* tensor) const {
  if (s.leave_result == nullptr || depth != 2) return false;
  if ((PyObject*)Py_TYPE(path[0]) != s.leave_result || (PyObject*)Py_TYPE(path[1]) != s.leave_logits) return false;
  if (!reads_at(path[0], s.leave_holder, path[1]) || !reads_at(path[1], s.leave_field, tensor)) return false;
  long held = 0;
  const bool read = each_value(s, path[0], [&](PyObject* v) { held += v == path[1]; return true; }, true);
  return read && held == 1;
}

bool Walk::found_shared(PyObject* tensor, uintptr_t address) {
  if (shared == nullptr && (shared = PyList_New(0)) == nullptr) return false;
  PyObject* holders = PyTuple_New(depth);
  if (holders == nullptr) return false;
  for (int i = 0; i < depth; ++i) PyTuple_SET_ITEM(holders, i, Py_NewRef(path[i]));
  PyObject* found = Py_BuildValue("(NOK)", holders, tensor, static_cast<unsigned long long>(address));
  const bool kept = found != nullptr && PyList_Append(shared, found) == 0;
  Py_XDECREF(found);
  return kept;
}

// One value a holder at `level` holds: true where the Python walk skips it or finds it clean.
bool Walk::value(PyObject* v, int level) {
  if (v == Py_None || PyLong_CheckExact(v) || PyBool_Check(v) || PyFloat_CheckExact(v) || PyUnicode_CheckExact(v)) {
    return true;  // leaves by holders' own rule: the walk skips them whatever KINDS has met
  }
  PyObject* kind = kind_of(s, Py_TYPE(v));
  if (kind == nullptr) return false;  // a type the walk has not met: it fills KINDS
  if (kind == s.leaf || v == epilogue) return true;
  if (--left < 0) return false;  // the walk's cut
  if (kind == s.tensor) {
    PyObject* tp = (PyObject*)Py_TYPE(v);
    if (tp != s.plain_tensor && tp != s.parameter) return false;  // a subclass may answer otherwise
    uintptr_t address;
    if (!address_of(THPVariable_Unpack(v), address)) return false;
    return std::find(s.storages.begin(), s.storages.end(), address) == s.storages.end() || left_in_place(v) ||
           found_shared(v, address);
  }
  if (level >= s.max_depth) return false;  // too deep: the walk reports it
  return holder(v, level + 1);
}

bool is_leaf(const BoundaryScan& s, PyObject* v) {
  // None, int, bool, float, str: leaves by holders' own rule, whatever KINDS has met (no lookup)
  if (v == Py_None || PyLong_CheckExact(v) || PyBool_Check(v) || PyFloat_CheckExact(v) || PyUnicode_CheckExact(v)) {
    return true;
  }
  return kind_of(s, Py_TYPE(v)) == s.leaf;
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
  PyObject* kind = kind_of(s, Py_TYPE(v));
  return kind != nullptr && kind != s.tensor;
}

// Every mapped tensor is over the very memory it was bound over, whatever a subclass would say: the
// same TensorImpl (not swapped), over the same StorageImpl (not set_ or .data = elsewhere), whose
// data is where it was (not moved by a resize_) and not turned copy-on-write (its deleter). This
// runs for every tensor of the epilogue's memory, every step, so in three passes of loads that do
// not wait on one another: each tensor's TensorImpl; then each impl's StorageImpl (the impls being
// the bound ones, alive); then each distinct storage's data and deleter (likewise).
bool tensors_hold(const BoundaryScan& s) {
  const size_t count = s.tensors.size();
  uintptr_t differs = 0;
  for (size_t i = 0; i < count; ++i) {
    PyObject* tensor = s.tensors[i];
    const bool plain = Py_TYPE(tensor) == (PyTypeObject*)s.plain_tensor || Py_TYPE(tensor) == (PyTypeObject*)s.parameter;
    if (!plain && !THPVariable_Check(tensor)) return false;
    const c10::TensorImpl* impl = THPVariable_Unpack(tensor).unsafeGetTensorImpl();
    differs |= reinterpret_cast<uintptr_t>(impl) ^ reinterpret_cast<uintptr_t>(s.impls[i]);
  }
  if (differs != 0) return false;
  for (size_t i = 0; i < count; ++i) {
    if (s.impls[i] == nullptr) return false;  // not read in place: the walk decides
    differs |= reinterpret_cast<uintptr_t>(s.impls[i]->unsafe_storage().unsafeGetStorageImpl()) ^
               reinterpret_cast<uintptr_t>(s.storage_impls[i]);
  }
  if (differs != 0) return false;
  for (size_t i : s.distinct_storages) {
    const c10::DataPtr& data = s.storage_impls[i]->data_ptr();
    if (reinterpret_cast<uintptr_t>(data.get()) != s.addresses[i] || data.get_deleter() != s.deleters[i]) return false;
  }
  return true;
}

// Node n (of the epilogue's map) holds what the map found: read from its instance slots where its
// type is as when found readable so (no lookups), else as _held reads it, after which it notes
// whether its slots alone can serve next time.
bool node_holds(const BoundaryScan& s, const Node& n, PyObject* epilogue) {
  PyObject* h = n.holder ? n.holder : epilogue;
  size_t at = 0;
  auto same = [&](PyObject* v) { return at < n.slots.size() && same_slot(s, v, n.slots[at++]); };
  const bool direct = n.offsets != nullptr && Py_TYPE(h) == n.slots_type && n.slots_tag == n.slots_type->tp_version_tag;
  const bool read = direct ? each_in_slots(h, *n.offsets, same) : each_held(s, h, same);
  if (!read || at != n.slots.size()) return false;
  if (!direct) {
    n.offsets = slots_only(s, h);
    n.slots_type = Py_TYPE(h);
    n.slots_tag = n.offsets != nullptr ? Py_TYPE(h)->tp_version_tag : 0;
  }
  return true;
}

// Whether a holder of type `tp` is read by vars(h) alone (holders.items: a holder with no names
// outside its __dict__); KINDS and _layouts keep what they found for a type, once.
bool read_by_vars(const BoundaryScan& s, PyTypeObject* tp) {
  PyObject* names;
  bool has_dict;
  const bool vars_alone = kind_of(s, tp) == s.holder && holder_layout(s, tp, names, has_dict) &&
                          PyTuple_GET_SIZE(names) == 0 && has_dict;
  if (PyErr_Occurred()) PyErr_Clear();
  return vars_alone;
}

// The values of dict `d` (node n's, as each_stored reads it) where the map marked a free or beyond
// slot: the same object may be judged otherwise later (its class assigned), which no version shows.
// They stay alive while d's version is the one compiled (d holds them), which is tested first.
void keep_marked(BoundaryScan::Compiled& c, const BoundaryScan& s, const Node& n, PyObject* d) {
  Py_ssize_t at = 0;
  size_t next = 0;
  PyObject *key, *v;
  while (PyDict_Next(d, &at, &key, &v) && next < n.slots.size()) {
    PyObject* mapped = n.slots[next++];
    if (mapped == s.free || mapped == s.beyond) c.kept.emplace_back(v, mapped);
  }
}

// same_state's holders as flat reads, from a full pass that just held: each slot of a holder read
// by its slots becomes a load compared with what it holds now (the very object the map found, or
// nullptr), its holder's type and that type's tag two more; a slot the map marked free, beyond or
// any is judged as same_slot judges it. A dict (its own storage) holds while its version is the
// same, and so does a holder read by vars(h) alone while its __dict__ is that same dict (a version
// is never given twice, so a dict made where another was cannot pass for it); their values the map
// marked free or beyond are judged again as same_slot judges them. The other nodes
// (lists, tuples, holders with slots and a __dict__) are read as node_holds reads them. The objects
// compared stay alive: the nodes own them.
void compile_state(const BoundaryScan& s, PyObject* epilogue) {
  BoundaryScan::Compiled c;
  for (size_t i = 0; i < s.nodes.size(); ++i) {
    const Node& n = s.nodes[i];
    PyObject* h = n.holder ? n.holder : epilogue;
    if (n.offsets == nullptr || Py_TYPE(h) != n.slots_type || n.slots_tag != n.slots_type->tp_version_tag) {
      if (PyDict_Check(h) && versions_kept()) {  // a dict's own storage, unchanged while its version is
        c.dicts.emplace_back(h, version_of(h));
        keep_marked(c, s, n, h);
        continue;
      }
      if (!PyList_Check(h) && !PyTuple_Check(h) && versions_kept() && read_by_vars(s, Py_TYPE(h))) {
        PyObject* d = PyObject_GetAttr(h, s.dict_name);
        if (d != nullptr && PyDict_CheckExact(d)) {
          const bool plain = plain_type(s, Py_TYPE(h)) && made_dict(h) == d;
          c.vars.push_back({n.holder, Py_TYPE(h), d, version_of(d), plain ? Py_TYPE(h)->tp_version_tag : 0});
          keep_marked(c, s, n, d);
          Py_DECREF(d);
          continue;
        }
        Py_XDECREF(d);
        if (PyErr_Occurred()) PyErr_Clear();
      }
      c.read.push_back(i);
      continue;
    }
    c.types.emplace_back(h, n.slots_type);
    if (std::find(c.tags.begin(), c.tags.end(), std::make_pair(n.slots_type, n.slots_tag)) == c.tags.end()) {
      c.tags.emplace_back(n.slots_type, n.slots_tag);
    }
    size_t next = 0;
    for (Py_ssize_t offset : *n.offsets) {
      PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(h) + offset);
      PyObject* mapped = *slot == nullptr ? nullptr : n.slots[next++];
      if (mapped == s.free || mapped == s.beyond || mapped == s.any) {
        c.marked.emplace_back(slot, mapped);
      } else {
        c.at.push_back(slot);
        c.was.push_back(mapped);
      }
    }
  }
  s.compiled = std::move(c);  // not ready: same_state says when it may serve
}

// The compiled holders hold: true only where a full pass would hold too (the same slots holding
// the same objects, each marked slot judged alike, each other node read alike).
bool compiled_holds(const BoundaryScan& s, PyObject* epilogue) {
  const BoundaryScan::Compiled& c = s.compiled;
  bool same = true;
  for (const auto& [holder, type] : c.types) same &= Py_TYPE(holder) == type;
  for (const auto& [type, tag] : c.tags) same &= type->tp_version_tag == tag;
  if (!same) return false;  // a slot's offset may mean something else now: nothing read through it
  for (size_t i = 0; i < c.at.size(); ++i) same &= *c.at[i] == c.was[i];
  for (const auto& [dict, version] : c.dicts) same &= version_of(dict) == version;
  if (!same) return false;
  for (const auto& v : c.vars) {  // getattr(h, "__dict__") as each_value calls it: the same dict, unchanged
    PyObject* h = v.holder ? v.holder : epilogue;
    if (Py_TYPE(h) != v.type) return false;
    if (v.plain_tag != 0 && v.plain_tag == v.type->tp_version_tag) {  // the made dict that getattr returns, in place
      if (made_dict(h) != v.dict || version_of(v.dict) != v.version) return false;
      continue;
    }
    PyObject* d = PyObject_GetAttr(h, s.dict_name);
    const bool held = d == v.dict && version_of(d) == v.version;
    Py_XDECREF(d);
    if (!held) return false;
  }
  auto judged = [&](PyObject* value, PyObject* marker) {
    return value != nullptr && handed(value, [&](PyObject* v) { return same_slot(s, v, marker); });
  };
  for (const auto& [value, marker] : c.kept) {  // alive: their dicts are as compiled
    if (!judged(value, marker)) return false;
  }
  for (const auto& [slot, marker] : c.marked) {
    if (!judged(*slot, marker)) return false;
  }
  for (size_t i : c.read) {
    if (!node_holds(s, s.nodes[i], epilogue)) return false;
  }
  return true;
}

// fence_boundary._fresh: the same epilogue, every holder mapped holding what it held, every
// tensor over the storage it had (a buffer re-pointed in place is the same object over other memory).
// The compiled form answers where it holds; else the full pass, which compiles anew where it holds.
bool same_state(const BoundaryScan& s, PyObject* epilogue) {
  if ((PyWeakref_CheckRef(s.owner) ? PyWeakref_GetObject(s.owner) : s.owner) != epilogue) return false;
  if (s.compiled.ready && compiled_holds(s, epilogue)) return tensors_hold(s);
  s.compiled.ready = false;
  auto full = [&] {
    for (const Node& n : s.nodes) {
      if (!node_holds(s, n, epilogue)) return false;
    }
    return tensors_hold(s);
  };
  if (!full()) return false;
  // The form compiled now serves only where a full pass made after it holds and nothing it keeps
  // changed meanwhile: a pass may run Python (a getattr) that changes a dict it keeps by version.
  compile_state(s, epilogue);
  if (!full()) {
    s.compiled.ready = false;
    return false;
  }
  s.compiled.ready = compiled_holds(s, epilogue);
  return true;
}

const char kScanCapsule[] = "dsv41.boundary_scan";

// What the Python walk would find in `result` (a new reference, never raised): True, no route and
// nothing said; a list of (the holders from the result down to the one keeping it, the tensor,
// its storage's address) for each tensor over the epilogue's storages where that is all it would
// find (it copies them and names their routes); False (unsure) for anything else.
PyObject* scan_result(const BoundaryScan& s, PyObject* result, PyObject* epilogue) {
  Walk walk{s, epilogue, s.max_values};
  bool read = false;
  try {
    read = same_state(s, epilogue) && walk.holder(result, 1);
  } catch (...) {
    read = false;
  }
  if (PyErr_Occurred()) PyErr_Clear();  // whatever failed: unsure, never raised
  if (read && walk.shared != nullptr) return walk.shared;
  Py_XDECREF(walk.shared);
  return Py_NewRef(read ? Py_True : Py_False);
}

PyObject* scan_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "scan(result, epilogue)");
    return nullptr;
  }
  auto* s = static_cast<BoundaryScan*>(PyCapsule_GetPointer(self, kScanCapsule));
  if (s == nullptr) return nullptr;
  return scan_result(*s, args[0], args[1]);
}

PyMethodDef kScanMethod = {"boundary_scan", (PyCFunction)(void (*)(void))scan_call, METH_FASTCALL,
                           "scan(result, epilogue) -> True: nothing in result shares the epilogue's storages (exact); "
                           "[(holders from result down, tensor, its storage's address), ...]: those share them and "
                           "are all the walk would find; False: unsure, run the Python walk"};

// A capsule's destructor: deletes the state it owns (its name is the one it was made with).
template <typename State>
void drop(PyObject* capsule) {
  delete static_cast<State*>(PyCapsule_GetPointer(capsule, PyCapsule_GetName(capsule)));
}

// fence_boundary.check_results with its clean step in C: wrapt calls it as
// check(wrapped, instance, args, kwargs). It calls through, reads the instance's epilogue as
// getattr(instance, name, None) does, and returns the result where there is nothing to check
// or the epilogue's bound scan (in fence_boundary's map, storages[id(epilogue)][4]) says
// clean; one tensor the scan found sharing the epilogue's storages is copied here where a Python
// copy already found its keys (copied_by_plan); anything else goes to `checked(result, epilogue,
// found)`, the Python form's rest, with what the scan found (False: unsure, or those tensors).
struct BoundaryCheck {
  PyObject* storages;  // fence_boundary._storages (owned references, all five)
  PyObject* checked;
  PyObject* name;
  PyObject* plans;     // fence_boundary._plans: the keys a Python copy found down a path, by the path's types
  PyObject* said;      // fence_boundary._said_copy: a copy's route counted and said
  // The last epilogue's bound scan, used while the map is the dict it was then (its version: any
  // entry added, replaced or dropped gives it a new one, and a dead epilogue's entry is dropped),
  // which keeps that scan alive: no id made and looked up at each step, and nothing kept here.
  PyObject* last_epilogue = nullptr;
  PyObject* last_scan = nullptr;
  uint64_t map_version = 0;
  ~BoundaryCheck() {
    for (PyObject* o : {storages, checked, name, plans, said}) Py_XDECREF(o);
  }
};

const char kCheckCapsule[] = "dsv41.boundary_check";

// The epilogue's bound scan from the map (a new reference), or nullptr where it holds none.
PyObject* bound_scan(BoundaryCheck& c, PyObject* epilogue) {
  const uint64_t version = versions_kept() ? version_of(c.storages) : 0;
  if (c.last_scan != nullptr && epilogue == c.last_epilogue && version != 0 && version == c.map_version) {
    return Py_NewRef(c.last_scan);
  }
  PyObject* key = PyLong_FromVoidPtr(epilogue);  // id(epilogue)
  if (key == nullptr) return nullptr;
  PyObject* cached = PyDict_GetItemWithError(c.storages, key);
  Py_DECREF(key);
  if (cached == nullptr || !PyTuple_CheckExact(cached) || PyTuple_GET_SIZE(cached) != 7) return nullptr;
  PyObject* scan = PyTuple_GET_ITEM(cached, 4);
  if (!PyCFunction_Check(scan) || PyCFunction_GET_FUNCTION(scan) != (PyCFunction)(void (*)(void))scan_call) return nullptr;
  c.last_scan = scan;
  c.last_epilogue = epilogue;
  c.map_version = version;
  return Py_NewRef(scan);  // the walk may run Python (a property) that drops it from the map
}

// getattr(holder, key) is `expected`, for a holder fence_boundary._at reads by getattr (not a list,
// tuple or dict); false where it is not or the read raised (cleared).
bool reads_at(PyObject* holder, PyObject* key, PyObject* expected) {
  if (!PyUnicode_CheckExact(key) || PyList_Check(holder) || PyTuple_Check(holder) || PyDict_Check(holder)) return false;
  PyObject* held = PyObject_GetAttr(holder, key);
  if (held == nullptr) PyErr_Clear();
  Py_XDECREF(held);
  return held == expected;
}

// fence_boundary._copied for one find, where _plans holds what a Python copy found for its path's
// types (the keys down it, the key of the tensor, its storage's address, its route) and each key
// still reads what the scan met: the tensor cloned and set in its holder, the route handed to `said`.
// False, nothing changed, where any of that differs: the Python form then serves.
bool copied_by_plan(BoundaryCheck& c, PyObject* found) {
  if (!PyList_CheckExact(found) || PyList_GET_SIZE(found) != 1) return false;
  PyObject* entry = PyList_GET_ITEM(found, 0);  // (holders, tensor, address): scan_result's
  PyObject* path = PyTuple_GET_ITEM(entry, 0);
  PyObject* tensor = PyTuple_GET_ITEM(entry, 1);
  const Py_ssize_t depth = PyTuple_GET_SIZE(path);
  PyObject* types = PyTuple_New(depth);
  if (types == nullptr) return false;
  for (Py_ssize_t i = 0; i < depth; ++i) PyTuple_SET_ITEM(types, i, Py_NewRef((PyObject*)Py_TYPE(PyTuple_GET_ITEM(path, i))));
  PyObject* plan = PyDict_GetItemWithError(c.plans, types);  // borrowed: the dict keeps it while nothing runs
  Py_DECREF(types);
  if (plan == nullptr || !PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 5) {
    PyErr_Clear();
    return false;
  }
  Py_INCREF(plan);  // the reads below may run Python (a property) that drops it from _plans
  PyObject *keys = PyTuple_GET_ITEM(plan, 0), *kept = PyTuple_GET_ITEM(plan, 2);
  PyObject *addresses = PyTuple_GET_ITEM(plan, 3), *routes = PyTuple_GET_ITEM(plan, 4);
  bool same = PyList_CheckExact(keys) && PyList_GET_SIZE(keys) == depth - 1 && PyList_CheckExact(kept) &&
              PyList_GET_SIZE(kept) == 1 && PyList_CheckExact(addresses) && PyList_GET_SIZE(addresses) == 1 &&
              PyList_CheckExact(routes) && PyList_GET_SIZE(routes) == 1 &&
              PyObject_RichCompareBool(PyList_GET_ITEM(addresses, 0), PyTuple_GET_ITEM(entry, 2), Py_EQ) == 1;
  for (Py_ssize_t i = 0; same && i + 1 < depth; ++i) {
    same = reads_at(PyTuple_GET_ITEM(path, i), PyList_GET_ITEM(keys, i), PyTuple_GET_ITEM(path, i + 1));
  }
  PyObject* holder = PyTuple_GET_ITEM(path, depth - 1);
  same = same && reads_at(holder, PyList_GET_ITEM(kept, 0), tensor);
  PyObject* copy = nullptr;
  if (same) {
    try {
      copy = THPVariable_Wrap(dense_copy(THPVariable_Unpack(tensor)));  // tensor.clone(), as _copied makes it
    } catch (...) {
      copy = nullptr;
    }
  }
  same = copy != nullptr && PyObject_SetAttr(holder, PyList_GET_ITEM(kept, 0), copy) == 0;  // _put's setattr
  Py_XDECREF(copy);
  if (same) {
    PyObject* said = PyObject_CallOneArg(c.said, PyList_GET_ITEM(routes, 0));
    Py_XDECREF(said);
  }
  Py_DECREF(plan);
  if (PyErr_Occurred()) PyErr_Clear();  // a count or line that failed is lost, never raised (as _said_copy's own)
  return same;
}

// The rest of a check once the wrapped call returned `result` (a new reference, consumed) for
// `instance`: the result itself where there is nothing to check or the scan says clean, else
// what the Python form's rest makes of it.
PyObject* checked_result(BoundaryCheck& c, PyObject* instance, PyObject* result) {
  PyObject* epilogue = PyObject_GetAttr(instance, c.name);
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
  PyObject* scan = bound_scan(c, epilogue);
  if (PyErr_Occurred()) PyErr_Clear();
  PyObject* found = scan == nullptr ? Py_NewRef(Py_False)
      : scan_result(*static_cast<BoundaryScan*>(PyCapsule_GetPointer(PyCFunction_GET_SELF(scan), kScanCapsule)),
                    result, epilogue);
  Py_XDECREF(scan);
  if (found == Py_True || copied_by_plan(c, found)) {
    Py_DECREF(found);
    Py_DECREF(epilogue);
    return result;
  }
  PyObject* out = PyObject_CallFunctionObjArgs(c.checked, result, epilogue, found, nullptr);
  Py_DECREF(found);
  Py_DECREF(result);
  Py_DECREF(epilogue);
  return out;
}

PyObject* check_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* c = static_cast<BoundaryCheck*>(PyCapsule_GetPointer(self, kCheckCapsule));
  if (c == nullptr) return nullptr;
  if (nargs != 4 || !PyTuple_Check(args[2]) || (args[3] != Py_None && !PyDict_Check(args[3]))) {
    PyErr_SetString(PyExc_TypeError, "check(wrapped, instance, args: tuple, kwargs: dict or None)");
    return nullptr;
  }
  PyObject* result = PyObject_Call(args[0], args[2], args[3] == Py_None ? nullptr : args[3]);
  return result == nullptr ? nullptr : checked_result(*c, args[1], result);
}

PyMethodDef kCheckMethod = {"boundary_check", (PyCFunction)(void (*)(void))check_call, METH_FASTCALL,
                            "check(wrapped, instance, args, kwargs) -> the wrapped call's result, checked"};

// The kernel file's method objects, each standing in for an engine function (`original`) as wrapt's
// binding of a Python form would, and cheaper: the class holds one once it serves (adapter.framework.
// patching.bind_faster). A method descriptor as a function is: bound on an instance (CPython then
// calls it with the instance first, without binding), itself on the class; any attribute it has not
// got is the function's (its code, globals, defaults), as wrapt's proxy reads it, and its __dict__
// holds what functools.update_wrapper copies (__wrapped__ too). wrapt's binding made a bound wrapper,
// an args tuple, a kwargs dict and a Python frame at every step for the same call (about 1 us of the
// step's host time each). Two kinds: boundary_method and fenced_method (below).
struct NativeMethod {
  PyObject_HEAD
  PyObject* original;  // the engine's function
  PyObject* inner;     // boundary_method: boundary_check's callable; fenced_method: the CheapForm
  PyObject* state;     // fenced_method: the form's __dict__
  PyObject* module;    // fenced_method: accept_snapshot's module dict
  PyObject* snapshot;  // fenced_method: this library's snapshot (accept_snapshot._snapshot while it serves)
  PyObject* dict;
  vectorcallfunc vectorcall;
};

PyObject* method_get(PyObject* self, PyObject* instance, PyObject*) {
  if (instance == nullptr || instance == Py_None) return Py_NewRef(self);
  return PyMethod_New(self, instance);
}

PyObject* method_getattro(PyObject* self, PyObject* name) {
  PyObject* found = PyObject_GenericGetAttr(self, name);
  if (found != nullptr || !PyErr_ExceptionMatches(PyExc_AttributeError)) return found;
  PyErr_Clear();
  return PyObject_GetAttr(reinterpret_cast<NativeMethod*>(self)->original, name);
}

int method_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* m = reinterpret_cast<NativeMethod*>(self);
  for (PyObject* o : {m->original, m->inner, m->state, m->module, m->snapshot, m->dict}) Py_VISIT(o);
  return 0;
}

int method_clear(PyObject* self) {
  auto* m = reinterpret_cast<NativeMethod*>(self);
  for (PyObject** o : {&m->original, &m->inner, &m->state, &m->module, &m->snapshot, &m->dict}) Py_CLEAR(*o);
  return 0;
}

void method_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  method_clear(self);
  Py_TYPE(self)->tp_free(self);
}

PyObject* method_repr(PyObject* self) {
  return PyUnicode_FromFormat("<%s %R>", Py_TYPE(self)->tp_name, reinterpret_cast<NativeMethod*>(self)->original);
}

// The type `t`, made ready once (nullptr where that failed, an error set).
PyTypeObject* method_type(PyTypeObject& t, const char* name, const char* doc) {
  if (t.tp_flags & Py_TPFLAGS_READY) return &t;
  t.tp_name = name;
  t.tp_basicsize = sizeof(NativeMethod);
  t.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL;
  t.tp_doc = doc;
  t.tp_vectorcall_offset = offsetof(NativeMethod, vectorcall);
  t.tp_dictoffset = offsetof(NativeMethod, dict);
  t.tp_call = PyVectorcall_Call;
  t.tp_descr_get = method_get;
  t.tp_getattro = method_getattro;
  t.tp_setattro = PyObject_GenericSetAttr;
  t.tp_traverse = method_traverse;
  t.tp_clear = method_clear;
  t.tp_dealloc = method_dealloc;
  t.tp_repr = method_repr;
  return PyType_Ready(&t) == 0 ? &t : nullptr;
}

// A new method of type `t` (ready) standing in for `original`, called through `call`; the rest unset.
NativeMethod* new_method(PyTypeObject* t, PyObject* original, vectorcallfunc call) {
  if (t == nullptr) throw pybind11::error_already_set();
  auto* m = PyObject_GC_New(NativeMethod, t);
  if (m == nullptr) throw pybind11::error_already_set();
  m->original = Py_NewRef(original);
  m->inner = m->state = m->module = m->snapshot = m->dict = nullptr;
  m->vectorcall = call;
  return m;
}

// boundary_method: the worker's method with the check in it, as the class holds it once the check
// serves in C: the engine's function called with the very arguments the caller passed (vectorcall,
// nothing packed), then checked_result.
PyObject* checked_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* m = reinterpret_cast<NativeMethod*>(self);
  PyObject* result = PyObject_Vectorcall(m->original, args, nargsf, kwnames);
  if (result == nullptr || PyVectorcall_NARGS(nargsf) < 1) return result;  // no instance: as the function answers
  auto* c = static_cast<BoundaryCheck*>(PyCapsule_GetPointer(PyCFunction_GET_SELF(m->inner), kCheckCapsule));
  if (c == nullptr) {
    Py_DECREF(result);
    return nullptr;
  }
  return checked_result(*c, args[0], result);
}

PyTypeObject kCheckedType = {PyVarObject_HEAD_INIT(nullptr, 0)};
PyTypeObject kFencedType = {PyVarObject_HEAD_INIT(nullptr, 0)};

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

// fence_forms.CheapForm's trusted call in C: TargetVerifyExecutor.accept_and_finalize as the class
// holds it once a batch size is trusted where this library tests the views (fence_forms binds it
// through adapter.framework.patching). A folded call at a trusted batch size whose every check
// holds as CheapForm.__call__ checks it (the form's state read from its __dict__ at each call,
// accept_snapshot's switches from its module dict) is served here: note_static_verify(bs) where
// the form says so, snapshot() of the cached views, the AcceptOuts built as the form builds it.
// Anything else, and whatever cannot be read exactly so, is the Python form's:
// form(the bound function, instance, args, kwargs), as wrapt's binding would call it. Nothing the
// engine can see runs before this decides, so handing over is always possible.
struct FenceNames {
  PyObject *folded_accept, *bs, *trusted, *context, *views, *read, *read_globals, *accept_outs, *buffers, *notes,
      *positional, *fields, *verify_epilogue, *read_accept, *dict, *AcceptOuts, *note_static_verify, *current,
      *snapshot, *mode;
};

const FenceNames& fence_names() {
  static const FenceNames made{interned("folded_accept"), interned("bs"), interned("trusted"), interned("context"),
                               interned("views"), interned("read"), interned("read_globals"), interned("accept_outs"),
                               interned("buffers"), interned("notes"), interned("positional"), interned("fields"),
                               interned("verify_epilogue"), interned("read_accept"), interned("__dict__"),
                               interned("AcceptOuts"), interned("note_static_verify"), interned("current"),
                               interned("_snapshot"), interned("_mode")};
  return made;
}

// The keyword `name`'s value among a vectorcall's (borrowed), or nullptr.
PyObject* keyword(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject* name) {
  if (kwnames == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyTuple_GET_ITEM(kwnames, i) == name) return args[nargs + i];
  }
  for (Py_ssize_t i = 0; i < n; ++i) {  // not interned by the caller: compared by value
    if (PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, i), name) == 0) return args[nargs + i];
  }
  return nullptr;
}

// Owned references taken for the trusted call: the form's state may change under any Python it runs.
struct Held {
  std::vector<PyObject*> refs;
  PyObject* operator()(PyObject* o) {
    if (o != nullptr) refs.push_back(Py_NewRef(o));
    return o;
  }
  ~Held() {
    for (PyObject* o : refs) Py_DECREF(o);
  }
};

// The trusted call's result (a new reference), or nullptr: with `served` false where the Python form
// must decide (any error of the checks cleared: the form meets it again, or not, by its own reads),
// with `served` true where note_static_verify, the copy or AcceptOuts raised (as they raise out of
// the Python form).
PyObject* trusted_call(NativeMethod& m, PyObject* instance, PyObject* bs, bool& served) {
  const FenceNames& k = fence_names();
  Held held;
  auto item = [&](PyObject* d, PyObject* key) { return held(PyDict_GetItemWithError(d, key)); };
  PyObject* trusted = item(m.state, k.trusted);
  if (trusted == nullptr || !PyAnySet_CheckExact(trusted) || PySet_Contains(trusted, bs) != 1) return nullptr;
  PyObject* context = item(m.state, k.context);
  PyObject* cached = item(m.state, k.views);
  PyObject* read = item(m.state, k.read);
  PyObject* read_globals = item(m.state, k.read_globals);
  PyObject* accept_outs = item(m.state, k.accept_outs);
  PyObject* getter = item(m.state, k.buffers);
  PyObject* notes = item(m.state, k.notes);
  PyObject* positional = item(m.state, k.positional);
  PyObject* fields = item(m.state, k.fields);
  PyObject* current = item(m.module, k.current);
  PyObject* serving = item(m.module, k.snapshot);
  PyObject* mode = item(m.module, k.mode);
  if (context == nullptr || !PyTuple_CheckExact(context) || PyTuple_GET_SIZE(context) != 3 || cached == nullptr ||
      !PyDict_CheckExact(cached) || read == nullptr || !PyFunction_Check(read) || read_globals == nullptr ||
      !PyDict_CheckExact(read_globals) || accept_outs == nullptr || getter == nullptr || notes == nullptr ||
      positional == nullptr || fields == nullptr || !PyTuple_CheckExact(fields) || current == nullptr ||
      !PyCFunction_Check(current) || PyCFunction_GET_FUNCTION(current) != (PyCFunction)(void (*)(void))views_call) {
    return nullptr;  // the views tested in Python (use_checks(None)), or a state not read here
  }
  PyObject* entry = item(cached, bs);
  if (entry == nullptr || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) return nullptr;
  PyObject *buffers = PyTuple_GET_ITEM(entry, 0), *views = PyTuple_GET_ITEM(entry, 1), *was = PyTuple_GET_ITEM(entry, 2);
  const Py_ssize_t n = PyList_CheckExact(views) ? PyList_GET_SIZE(views) : -1;
  if (n < 1 || PyTuple_GET_SIZE(fields) != n) return nullptr;
  std::vector<at::Tensor> srcs;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* view = PyList_GET_ITEM(views, i);
    if (!THPVariable_Check(view)) return nullptr;
    srcs.push_back(THPVariable_Unpack(view));
  }
  if (srcs[0].is_cuda() && (mode == nullptr || mode == Py_None || serving != m.snapshot)) return nullptr;
  // The form's checks, in its order: its epilogue, the executor's class, read_accept as the class and
  // the instance give it, the AcceptOuts read_accept builds, the buffers over the memory cut from.
  PyObject* epilogue = PyObject_GetAttr(instance, k.verify_epilogue);
  if (epilogue == nullptr) return nullptr;
  held.refs.push_back(epilogue);
  PyTypeObject* kind = Py_TYPE(epilogue);
  if (epilogue != PyTuple_GET_ITEM(context, 1) || (PyObject*)Py_TYPE(instance) != PyTuple_GET_ITEM(context, 0) ||
      Py_TYPE(kind) != &PyType_Type || _PyType_Lookup(kind, k.read_accept) != read) {
    return nullptr;  // a metaclass may answer type(epilogue).read_accept otherwise: the form decides
  }
  PyObject* own = PyObject_GetAttr(epilogue, k.dict);
  if (own == nullptr) return nullptr;
  held.refs.push_back(own);
  if (!PyDict_CheckExact(own) || PyDict_Contains(own, k.read_accept) != 0) return nullptr;
  if (item(read_globals, k.AcceptOuts) != accept_outs) return nullptr;
  PyObject* live = PyObject_CallOneArg(getter, epilogue);
  if (live == nullptr) return nullptr;
  held.refs.push_back(live);
  PyObject* check[3] = {buffers, live, was};
  PyObject* same = views_call(nullptr, check, 3);
  Py_XDECREF(same);
  if (same != Py_True) return nullptr;
  // Trusted: what CheapForm.__call__ does from here, errors and all.
  served = true;
  const int note = PyObject_IsTrue(notes);
  if (note < 0) return nullptr;
  if (note == 1) {
    PyObject* noted = PyObject_CallMethodOneArg(epilogue, k.note_static_verify, bs);
    if (noted == nullptr) return nullptr;
    Py_DECREF(noted);
  }
  std::vector<at::Tensor> copies;
  try {
    copies = snapshot(srcs);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  std::vector<PyObject*> out;
  for (auto& t : copies) {
    PyObject* wrapped = THPVariable_Wrap(std::move(t));
    if (wrapped == nullptr) {
      for (PyObject* o : out) Py_DECREF(o);
      return nullptr;
    }
    out.push_back(wrapped);
  }
  const int by_position = PyObject_IsTrue(positional);
  PyObject* result = by_position < 0 ? nullptr
      : by_position == 1 ? PyObject_Vectorcall(accept_outs, out.data(), out.size(), nullptr)
                         : PyObject_Vectorcall(accept_outs, out.data(), 0, fields);
  for (PyObject* o : out) Py_DECREF(o);
  return result;
}

PyObject* fenced_vectorcall(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* m = reinterpret_cast<NativeMethod*>(self);
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  if (nargs < 1) return PyObject_Vectorcall(m->original, args, nargsf, kwnames);  // as the function answers
  const FenceNames& k = fence_names();
  PyObject* folded = keyword(args, nargs, kwnames, k.folded_accept);
  PyObject* bs = keyword(args, nargs, kwnames, k.bs);
  if (nargs == 1 && folded != nullptr && bs != nullptr) {
    const int on = PyObject_IsTrue(folded);
    if (on < 0) return nullptr;  // as kwargs.get("folded_accept") raises it
    if (on == 1) {
      bool served = false;
      PyObject* result = trusted_call(*m, args[0], bs, served);
      if (result != nullptr || served) return result;
      PyErr_Clear();
    }
  }
  // The Python form, called as wrapt's binding calls it.
  PyObject* bound = PyMethod_New(m->original, args[0]);
  PyObject* rest = PyTuple_New(nargs - 1);
  PyObject* kwargs = PyDict_New();
  PyObject* result = nullptr;
  if (bound != nullptr && rest != nullptr && kwargs != nullptr) {
    for (Py_ssize_t i = 1; i < nargs; ++i) PyTuple_SET_ITEM(rest, i - 1, Py_NewRef(args[i]));
    bool ok = true;
    for (Py_ssize_t i = 0; kwnames != nullptr && ok && i < PyTuple_GET_SIZE(kwnames); ++i) {
      ok = PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) == 0;
    }
    if (ok) result = PyObject_CallFunctionObjArgs(m->inner, bound, args[0], rest, kwargs, nullptr);
  }
  Py_XDECREF(bound);
  Py_XDECREF(rest);
  Py_XDECREF(kwargs);
  return result;
}

}  // namespace

pybind11::object boundary_check(pybind11::dict storages, pybind11::object checked, pybind11::str name,
                                pybind11::dict plans, pybind11::object said) {
  auto* c = new BoundaryCheck{storages.inc_ref().ptr(), checked.inc_ref().ptr(), name.inc_ref().ptr(),
                              plans.inc_ref().ptr(), said.inc_ref().ptr()};
  return bound_function(c, kCheckCapsule, &kCheckMethod);
}

pybind11::object boundary_method(pybind11::function original, pybind11::object check) {
  TORCH_CHECK(PyFunction_Check(original.ptr()), "boundary_method: original must be a plain function");
  TORCH_CHECK(PyCFunction_Check(check.ptr()) &&
                  PyCFunction_GET_FUNCTION(check.ptr()) == (PyCFunction)(void (*)(void))check_call,
              "boundary_method: check must be what boundary_check returned");
  NativeMethod* m = new_method(method_type(kCheckedType, "sglang_adapters.boundary_checked_method",
                                           "a worker method whose results the fence's boundary check compares"),
                               original.ptr(), checked_vectorcall);
  m->inner = check.inc_ref().ptr();
  PyObject_GC_Track(m);
  return pybind11::reinterpret_steal<pybind11::object>(reinterpret_cast<PyObject*>(m));
}

pybind11::object fenced_method(pybind11::function original, pybind11::object form, pybind11::dict module,
                               pybind11::object snapshot_function) {
  TORCH_CHECK(PyFunction_Check(original.ptr()), "fenced_method: original must be a plain function");
  fence_names();  // the names its calls read, made here where a failure may raise
  PyObject* state = PyObject_GenericGetDict(form.ptr(), nullptr);
  if (state == nullptr) throw pybind11::error_already_set();
  NativeMethod* m = nullptr;
  try {
    m = new_method(method_type(kFencedType, "sglang_adapters.fenced_method",
                               "accept_and_finalize with the fence's trusted cheap form in it"),
                   original.ptr(), fenced_vectorcall);
  } catch (...) {
    Py_DECREF(state);
    throw;
  }
  m->inner = form.inc_ref().ptr();
  m->state = state;
  m->module = module.inc_ref().ptr();
  m->snapshot = snapshot_function.inc_ref().ptr();
  PyObject_GC_Track(m);
  return pybind11::reinterpret_steal<pybind11::object>(reinterpret_cast<PyObject*>(m));
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
                               std::vector<uint64_t> storages, int64_t max_depth, int64_t max_values,
                               pybind11::object leave) {
  TORCH_CHECK(kind_names.size() == 5 && tensor_types.size() == 2 && markers.size() == 3 &&
              tensors.size() == addresses.size(), "boundary_scan: bad arguments");
  TORCH_CHECK(leave.is_none() || (pybind11::isinstance<pybind11::tuple>(leave) && pybind11::len(leave) == 4),
              "boundary_scan: leave is None or (result type, logits type, holder name, field name)");
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
  for (size_t i = 0; i < s->tensors.size(); ++i) {  // what each is over now, as the map read it
    uintptr_t address = 0;
    bool readable = false;
    try {
      readable = THPVariable_Check(s->tensors[i]) && address_of(THPVariable_Unpack(s->tensors[i]), address) &&
                 address == s->addresses[i];
    } catch (...) {  // a storage that cannot be read here: left to the walk
    }
    if (PyErr_Occurred()) PyErr_Clear();
    const c10::TensorImpl* impl = readable ? THPVariable_Unpack(s->tensors[i]).unsafeGetTensorImpl() : nullptr;
    s->impls.push_back(impl);  // nullptr: never fresh, the Python walk decides
    s->storage_impls.push_back(impl ? impl->unsafe_storage().unsafeGetStorageImpl() : nullptr);
    s->deleters.push_back(impl ? impl->unsafe_storage().data_ptr().get_deleter() : nullptr);
  }
  for (size_t i = 0; i < s->tensors.size(); ++i) {
    const auto first = std::find(s->storage_impls.begin(), s->storage_impls.end(), s->storage_impls[i]);
    if (s->storage_impls[i] != nullptr && first == s->storage_impls.begin() + i) s->distinct_storages.push_back(i);
  }
  s->storages.assign(storages.begin(), storages.end());
  s->max_depth = (int)max_depth;
  s->max_values = (long)max_values;
  if (!leave.is_none()) {
    auto spec = leave.cast<pybind11::tuple>();
    s->leave_result = own(spec[0]);
    s->leave_logits = own(spec[1]);
    s->leave_holder = PyUnicode_InternFromString(spec[2].cast<std::string>().c_str());
    s->leave_field = PyUnicode_InternFromString(spec[3].cast<std::string>().c_str());
  }
  return bound_function(s, kScanCapsule, &kScanMethod);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("snapshot", snapshot, "snapshot");
  m.def("empty_launch", empty_launch, "empty_launch");
  m.def("build_info", build_info, "build_info");
  m.def("pack", pack, "pack");
  m.def("count_divergence", count_divergence, "count_divergence");
  m.def("count_pair", count_pair, "count_pair");
  m.def("receive", receive, "receive");
  m.def("dense_copy", dense_copy, "dense_copy");
  m.def("boundary_scan", boundary_scan, "boundary_scan");
  m.def("boundary_check", boundary_check, "boundary_check");
  m.def("boundary_method", boundary_method, "boundary_method");
  m.def("fenced_method", fenced_method, "fenced_method");
  m.def("report_sync", report_sync, "report_sync");
  m.def("views_check", views_check, "views_check");
  m.def("layout", layout, "layout");
}
