"""Proofs kept across processes: what the checks compute from the engine's sources alone,
stored under the content of those sources and reused only on an exact match.

Every rank decides what the image build's `doctor --strict` already decided on the same
tree, and most of that time goes to reading the engine's sources (the census scans all
4,700 files; the contracts parse and index the modules they check). A result computed from
sources alone is stored under a key made of the sha256 of each source it read (the census's:
of every .py file of the tree), the pack's own sources, the Python that ran it and its other
inputs; a tree that differs in one byte from the proven one gives another key and is proven
again. What the checks probe in the live engine (its classes and functions, the bindings
the audit walks, its SpecTpSync run) is never stored: it runs in every process. A source
tree's SpecTpSync, run in a child interpreter, is stored under the content of the files
that decide it (spectpsync.observation).

A file's sha256 is computed again when its stat changed (device, inode, size, modification
and change times, the way git's index knows a file unchanged); a file changed within
RACY_NS of being hashed is always hashed again. The change time cannot be set back without
setting the clock: a file written, copied or unpacked anew is hashed anew.

Where: DSV41_ADAPTERS_PROOF_CACHE (engine.settings) names the folder (`off`: none); by default the image's
folder (IMAGE_FOLDER, filled by `doctor --strict` when the image is built) and the user's
cache folder. Entries are read from each and written to the first that can be written. A
folder missing or read-only is never an error: said once, the proofs run. An entry is
marshal'd plain data after the sha256 of its bytes; one that is corrupt or not its key's
is ignored and said once. Several ranks start at once: each entry is written to a
temporary file and renamed into place.
"""

from __future__ import annotations

import hashlib
import marshal
import os
import pathlib
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Optional

from . import settings

ENV = settings.PROOF_CACHE
OFF_WORDS = ("0", "off", "false", "none")  # as the flags' (framework.flags), any case
IMAGE_FOLDER = "/opt/sglang-dsv41/proofs"  # made by the image build, never by this module
FORMAT = 1  # the entries' layout: a change makes every stored entry another key
RACY_NS = 2_000_000_000  # a file changed this close to its hashing may change again unseen
MISSING = object()
KEEP_IN_MEMORY = 4096  # entries this process keeps once read or written (the oldest go first)

_PACK = pathlib.Path(__file__).resolve().parent.parent
_said: set = set()
_notes: list = []
_memory: dict = {}  # entry name -> value: what this process read or wrote


def folders(environ=os.environ) -> list[pathlib.Path]:
    """Where entries are looked for, in order; new ones go to the first that takes them.
    $DSV41_ADAPTERS_PROOF_CACHE alone where it is set (an off word: none), else the
    image's folder where it exists and the user's cache folder."""
    named = (settings.get(ENV, environ) or "").strip()
    if named:
        return [] if named.lower() in OFF_WORDS else [pathlib.Path(named)]
    home = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [pathlib.Path(IMAGE_FOLDER), pathlib.Path(home) / "sglang-dsv41-adapters" / "proofs"]


def _say(about, note: str) -> None:
    """A problem of the cache, said once per process for `about` (runtime prints it)."""
    if about not in _said:
        _said.add(about)
        _notes.append(note)


def notes() -> list[str]:
    """What the cache has to say since it was last asked (a folder it cannot use, an entry it ignored)."""
    taken = list(_notes)
    _notes.clear()
    return taken


def forget() -> None:
    """Forget what this process read, wrote and hashed (tests: the next look-up reads the folders)."""
    _memory.clear()
    _names.clear()
    _digests.clear()
    _said.clear()
    _notes.clear()


def digest(data) -> str:
    """sha256 of a text (utf-8) or bytes."""
    return hashlib.sha256(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data).hexdigest()


_pack_digest: Optional[str] = None


def pack_digest() -> str:
    """The pack's own sources: a change to any of them makes every stored entry another key."""
    global _pack_digest
    if _pack_digest is None:
        found = hashlib.sha256()
        for path in sorted(_PACK.rglob("*.py")):
            found.update(str(path.relative_to(_PACK)).encode() + b"\0" + path.read_bytes() + b"\0")
        _pack_digest = found.hexdigest()
    return _pack_digest


_PLAIN = (str, bytes, int, float, bool, type(None))


def _plain(key) -> bool:
    """A key spelt the same in every process: tuples of strings, bytes and numbers (a set's
    or a dict's order follows hashing, which differs between processes)."""
    return all(map(_plain, key)) if type(key) is tuple else isinstance(key, _PLAIN)


_names: dict = {}  # (kind, key) -> (entry name, material): a decision asks for the same keys many times


def _name(kind: str, key: tuple) -> tuple[str, str]:
    try:
        return _names[kind, key]
    except (KeyError, TypeError):  # TypeError: a key that cannot be hashed, refused below
        pass
    if not _plain(key):
        raise TypeError(f"a proof cache key must be a tuple of strings, bytes and numbers: {key!r}")
    material = repr((FORMAT, kind, key, pack_digest(), sys.version, sys.implementation.cache_tag))
    if len(_names) >= KEEP_IN_MEMORY:
        _names.clear()
    _names[kind, key] = found = f"{kind}-{digest(material)}", material
    return found


def _untrusted(path: pathlib.Path, *, entry: bool = False) -> Optional[str]:
    """Why `path` is not to be trusted, None where only this user (or root) could have written
    it, as ssh's StrictModes and git's safe.directory judge: it and each folder above it owned
    by root or this user and writable by no one else (a folder above may be, with its sticky
    bit, as /tmp is: no one else can then replace what is in it)."""
    me = os.getuid() if hasattr(os, "getuid") else None
    if me is None:
        return None  # no owners to compare on this platform
    chain = [path] + list(path.parents)
    for at, item in enumerate(chain):
        try:
            found = os.lstat(item)
        except OSError:
            return f"{item} cannot be read"
        if found.st_uid not in (0, me):
            return f"{item} belongs to uid {found.st_uid}, not to this user (uid {me}) or root"
        sticky = stat.S_ISDIR(found.st_mode) and found.st_mode & stat.S_ISVTX
        if found.st_mode & 0o022 and (at == 0 or not sticky):
            return f"{item} can be written by other users (mode {stat.S_IMODE(found.st_mode):o})"
        if at == 0 and entry and not stat.S_ISREG(found.st_mode):
            return f"{item} is not a regular file"
    return None


def _trusted(folder: pathlib.Path, name: Optional[str] = None) -> bool:
    """Whether the folder (and its entry `name`) may be read or written; said once per folder
    where not: the proofs are made again, nothing of it is used."""
    why = _untrusted(folder)
    if why is None and name is not None:
        why = _untrusted(folder / name, entry=True)
    if why is not None:
        _say(("untrusted", folder), f"proof cache: {folder} is not used: {why}; another user could have written what "
                                    "it holds, so the proofs are made again (a folder of this user's own: {ENV})"
                                    .replace("{ENV}", ENV))
    return why is None


def get(kind: str, key: tuple):
    """The value stored for `key` (plain data: tuples, strings, numbers), or MISSING. Only a
    folder and entry no other user could have written are read (_untrusted)."""
    name, material = _name(kind, key)
    if name in _memory:
        return _memory[name]
    for folder in folders():
        try:
            data = (folder / name).read_bytes()
        except OSError:
            continue
        if not _trusted(folder, name):
            continue
        found = _decode(data, material)
        if found is MISSING:
            _say(("ignored", folder), f"proof cache: ignored {folder / name}, corrupt or not its key's (and any other "
                                      f"such entry of {folder}): what it held is proven again")
            continue
        _remember(name, found)
        return found
    return MISSING


def _remember(name: str, value) -> None:
    _memory[name] = value
    while len(_memory) > KEEP_IN_MEMORY:
        _memory.pop(next(iter(_memory)))


def _decode(data: bytes, material: str):
    check, _, payload = data.partition(b"\n")
    if check != hashlib.sha256(payload).hexdigest().encode():
        return MISSING
    try:
        stored_material, value = marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return MISSING
    return value if stored_material == material else MISSING


def put(kind: str, key: tuple, value) -> None:
    """Store `value` for `key` in the first folder that takes it (none: said once)."""
    name, material = _name(kind, key)
    _remember(name, value)
    payload = marshal.dumps((material, value))
    data = hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    where = [folder for folder in folders() if not folder.exists() or _trusted(folder)]  # the rest said once
    for folder in where:
        if _write(folder, name, data):
            return
    if where:
        _say("unwritten", f"proof cache: {' nor '.join(map(str, where))} can be written: the proofs of this process "
                          f"are not kept for the next ({ENV} names another folder)")


def _write(folder: pathlib.Path, name: str, data: bytes) -> bool:
    try:
        if str(folder) != IMAGE_FOLDER and not folder.exists():
            folder.mkdir(parents=True, exist_ok=True)  # ranks starting at once make it together
            os.chmod(folder, 0o755)  # whatever the umask: a folder others could write would not be trusted
        if not folder.is_dir() or not _trusted(folder):
            return False  # missing (the image's folder is made by its build only), or one another user could replace
        handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
    except OSError:
        return False
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, folder / name)
        return True
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        return False


def cached(kind: str, key: tuple, compute: Callable[[], object]):
    """compute()'s value, stored under `key`: computed only where no entry matches. A value
    that is an exception raised by compute is not stored (it is raised again next time)."""
    found = get(kind, key)
    if found is MISSING:
        found = compute()
        put(kind, key, found)
    return found


def key_of(parts: tuple) -> tuple:
    """A key of texts and plain values: each text (str or bytes) by its sha256."""
    return tuple(("sha256", digest(part)) if isinstance(part, (str, bytes)) else part for part in parts)


def memo(kind: str):
    """A function of texts (str or bytes, keyed by their sha256) and plain values, whose result
    is plain data, kept across processes under `kind`."""
    def decorate(function):
        def kept(*args):
            return cached(kind, key_of(args), lambda: function(*args))
        kept.__wrapped__, kept.__name__, kept.__doc__ = function, function.__name__, function.__doc__
        return kept
    return decorate


# ---------------------------------------------------------------- the files' own digests


_digests: dict = {}  # path -> (stat signature, sha256): this process's


def _signature(path: str) -> Optional[tuple]:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns)


def _settled(signature: tuple, read_at: int) -> bool:
    """Whether what was read of a file at `read_at` holds while its stat stays `signature`:
    not where it changed within RACY_NS of that reading (it may change again in the same tick)."""
    return max(signature[3], signature[4]) < read_at - RACY_NS


def _sha256_of(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            return digest(handle.read())
    except OSError:
        return None


def _hash(path: str, signature: Optional[tuple]) -> tuple[Optional[str], bool]:
    """(the file's sha256, None where it cannot be read; whether that may be trusted while the
    file's stat stays `signature`: not where it changed within RACY_NS of being read)."""
    started = time.time_ns()
    value = _sha256_of(path)
    return value, value is not None and signature is not None and _settled(signature, started)


def read_while_unchanged(kept: dict, path: str, read: Callable[[], object], keep: Optional[int] = None):
    """read()'s value for the file at `path`, kept in `kept` ({path: (its stat, the value)}) and
    read again only where the file's stat changed since, or changed within RACY_NS of that
    reading; None (a file that could not be read) is never kept. `keep`: at most that many
    files (the oldest go first)."""
    signature = _signature(path)
    known = kept.get(path)
    if signature is not None and known is not None and known[0] == signature:
        return known[1]
    started = time.time_ns()
    value = read()
    if value is not None and signature is not None and _settled(signature, started):
        while keep is not None and len(kept) >= keep:
            del kept[next(iter(kept))]
        kept[path] = (signature, value)
    return value


def content_digest(path: str) -> Optional[str]:
    """One file's sha256, hashed again only where its stat changed (None: not a readable file)."""
    return read_while_unchanged(_digests, path, lambda: _sha256_of(path))


def _place(path: str) -> tuple[str, str]:
    """(the folder a file's digest is recorded under, the path in it): the folder holding the
    file's sglang/ package, else the file's own folder."""
    head, found, tail = path.rpartition(f"{os.sep}sglang{os.sep}")
    return (head, f"sglang{os.sep}{tail}") if found else os.path.split(path)


def file_digests(paths: Iterable[str]) -> tuple[str, ...]:
    """The sha256 of each file, hashed again only where its stat changed since it was hashed
    (here or by an earlier process of this cache) or changed within RACY_NS of that. What
    was hashed is recorded per folder (the one holding sglang/): {path in it: (stat, sha256)}."""
    records, changed, found = {}, set(), []
    for path in paths:
        signature = _signature(path)
        known = _digests.get(path)
        if known is None or known[0] != signature:
            root, name = _place(path)
            if root not in records:
                stored = get("digests", (root,))
                records[root] = dict(stored) if isinstance(stored, dict) else {}
            known = records[root].get(name)
        if signature is not None and known is not None and known[0] == signature:
            _digests[path] = known
            found.append(known[1])
            continue
        value, trusted = _hash(path, signature)
        found.append(value or "unreadable")
        if trusted:
            _digests[path] = (signature, value)
            root, name = _place(path)
            records[root][name] = (signature, value)
            changed.add(root)
    for root in sorted(changed):
        put("digests", (root,), records[root])
    return tuple(found)


def tree_digest(files: Iterable[tuple[str, str]]) -> str:
    """One key for a set of (module, path) files: their names and contents."""
    files = tuple(files)
    contents = file_digests(path for _, path in files)
    return digest("\n".join(f"{module}\0{value}" for (module, _), value in zip(files, contents)))
