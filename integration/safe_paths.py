"""Every file or folder name a node receives is resolved here, only inside ComfyUI's folders for its kind.

A name is relative to ComfyUI's folder for its kind (`models/<kind>` and the extra_model_paths entries,
or the output folder for writes): no absolute path, no drive, no '..', no control characters, bounded
length. Reads must name an entry the node's dropdown would list (a file with the right extension, a
folder with the right marker, each passing the node's own `accept` check); symlinks placed inside a
models folder are followed, as core's loaders do. A refused name gets one message whatever exists on
disk, so errors are no oracle for paths outside. Writes go under the output folder only and never
replace an existing file: a counter suffix is added instead.

The listing helpers feed the nodes' dropdowns, so the choices offered are exactly the names accepted.
"""

from __future__ import annotations

import functools
import os
import re
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from .. import compat

MAX_NAME_CHARS = 1024
MAX_NAME_PARTS = 16
MAX_PART_BYTES = 255  # NAME_MAX on Linux, macOS and NTFS
MAX_LISTED_PER_FOLDER = 2000  # entries looked at per folder while listing (bounded time)
MAX_COUNTER = 99999
_DRIVE = re.compile(r"^[A-Za-z]:")

# accept(path) -> None when the entry is usable, else a short reason ("no config.json", ...)
Accept = Callable[[str], "str | None"]


class PathRefused(ValueError):
    """A name that is not one of the entries ComfyUI's folders offer for this input."""


def name_problem(name) -> str | None:
    """Why `name` can never be a relative entry name (no file system access), or None."""
    if not isinstance(name, str) or not name.strip():
        return "no name was given"
    if len(name) > MAX_NAME_CHARS:
        return f"the name is {len(name)} characters long (at most {MAX_NAME_CHARS})"
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return "the name contains control characters"
    unified = name.replace("\\", "/")
    if unified.startswith("/") or _DRIVE.match(unified):
        return "absolute paths are not accepted"
    parts = _parts(unified)
    if ".." in parts:
        return "'..' is not accepted"
    if not parts:
        return "no name was given"
    if len(parts) > MAX_NAME_PARTS:
        return f"the name has {len(parts)} folder levels (at most {MAX_NAME_PARTS})"
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_PART_BYTES for p in parts):
        return f"a part of the name is longer than {MAX_PART_BYTES} bytes"
    return None


def _parts(name: str) -> list[str]:
    return [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]


def _refuse(what: str, kind: str, name, why: str) -> PathRefused:
    shown = repr(name) if not isinstance(name, str) or len(name) <= 120 else repr(name[:117] + "...")
    return PathRefused(
        f"{what} {shown} was refused: {why}. Names are relative to ComfyUI's models/{kind} folder; "
        f"pick an entry from the list (put the file under models/{kind}/ or a folder listed in "
        f"extra_model_paths.yaml, then refresh the page)."
    )


def _checked_parts(what: str, kind: str, name) -> list[str]:
    problem = name_problem(name)
    if problem is not None:
        raise _refuse(what, kind, name, problem)
    return _parts(name)


def resolve_model_file(
    kind: str, name: str, exts: tuple[str, ...], accept: Accept | None = None, what: str = "file"
) -> str:
    """The path of file `name` in ComfyUI's folder `kind` (first root that has it, as core searches)."""
    parts = _checked_parts(what, kind, name)
    if not parts[-1].lower().endswith(exts):
        raise _refuse(what, kind, name, f"only {', '.join(exts)} files are accepted here")
    path = _first_existing(kind, parts, os.path.isfile)
    if path is None:
        raise _refuse(what, kind, name, "no such file")
    return _accepted(path, accept, what, name)


def resolve_model_folder(kind: str, name: str, accept: Accept, what: str = "folder") -> str:
    """The path of sub-folder `name` of ComfyUI's folder `kind` that passes `accept`."""
    path = _first_existing(kind, _checked_parts(what, kind, name), os.path.isdir)
    if path is None:
        raise _refuse(what, kind, name, "no such folder")
    return _accepted(path, accept, what, name)


def _accepted(path: str, accept: Accept | None, what: str, name: str) -> str:
    problem = None if accept is None else _check(accept, path)
    if problem is not None:
        raise PathRefused(f"{what} {name!r} cannot be used here: {problem}.")
    return path


def list_model_files(kind: str, exts: tuple[str, ...], accept: Accept | None = None) -> list[str]:
    """The dropdown of a file input: the files ComfyUI lists for `kind` that `resolve_model_file` accepts."""
    names = [n for n in compat.model_file_list(kind) if n.lower().endswith(exts) and name_problem(n) is None]
    if accept is None:
        return names
    out = []
    for name in names:
        path = _first_existing(kind, _parts(name), os.path.isfile)
        if path is not None and _check(accept, path) is None:
            out.append(name)
    return out


def list_model_folders(kind: str, accept: Accept, depth: int = 2) -> list[str]:
    """The dropdown of a folder input: sub-folders (up to `depth` levels) of `kind`'s roots that pass `accept`."""
    found: set[str] = set()

    def walk(folder: str, rel: str, level: int):
        try:
            entries = sorted(os.listdir(folder))[:MAX_LISTED_PER_FOLDER]
        except OSError:
            return
        for entry in entries:
            path = os.path.join(folder, entry)
            if entry.startswith(".") or not os.path.isdir(path):
                continue
            name = f"{rel}/{entry}" if rel else entry
            if _check(accept, path) is None:
                found.add(name)
            if level < depth:
                walk(path, name, level + 1)

    for root in compat.model_folder_roots(kind):
        walk(root, "", 1)
    return sorted(found)


def _first_existing(kind: str, parts: list[str], exists: Callable[[str], bool]) -> str | None:
    """The entry in the first root of `kind` that has it, as core searches."""
    for root in compat.model_folder_roots(kind):
        path = os.path.join(root, *parts)
        if exists(path):
            return path
    return None


def _check(accept: Accept, path: str) -> str | None:
    """accept(path); for a file remembered while its size and mtime stay the same: ComfyUI lists the inputs of
    every node on each /prompt, so a check that reads a file header must not run again for the same file."""
    if not os.path.isfile(path):
        return _run_check(accept, path)
    st = os.stat(path)
    return _check_file_once(accept, path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _check_file_once(accept: Accept, path: str, size: int, mtime_ns: int) -> str | None:
    return _run_check(accept, path)


def _run_check(accept: Accept, path: str) -> str | None:
    try:
        return accept(path)
    except OSError as err:
        return f"it cannot be read ({err.strerror or type(err).__name__})"
    except ValueError as err:  # a damaged config.json or header: the entry is not offered, and says why
        return str(err)


# ---------------------------------------------------------------------------------------------------------------
# writes


def output_file_path(name: str, ext: str, what: str = "save_as") -> tuple[str, str]:
    """(folder, file name) under ComfyUI's output folder for `name` (+ `ext` if missing), checked without
    writing anything: call it before heavy work so a bad name fails first."""
    _, folder, file = _output_target(name, ext, what)
    return folder, file


def _output_target(name: str, ext: str, what: str) -> tuple[str, str, str]:
    """(output folder, folder of the file, file name) for `name`, both folders resolved (no symlink left in them)."""
    name = name.strip() if isinstance(name, str) else name
    problem = name_problem(name)
    if problem is not None:
        raise PathRefused(
            f"{what} {name!r} was refused: {problem}. Give a file name relative to ComfyUI's output "
            f"folder, e.g. my_prompt{ext} or prompts/my_prompt{ext}."
        )
    parts = _parts(name)
    if not parts[-1].endswith(ext):
        parts[-1] += ext
    if len(parts[-1].encode("utf-8", "surrogatepass")) > MAX_PART_BYTES - 6:  # room for the counter suffix
        raise PathRefused(f"{what} {name!r} was refused: the file name is longer than {MAX_PART_BYTES - 6} bytes.")
    root = os.path.realpath(compat.output_directory())
    folder = os.path.realpath(os.path.join(root, *parts[:-1]))
    if os.path.commonpath([root, folder]) != root:
        raise PathRefused(
            f"{what} {name!r} was refused: it leads outside ComfyUI's output folder (through a "
            f"symbolic link). Give a plain file name such as my_prompt{ext}."
        )
    return root, folder, parts[-1]


def resolve_output_file(name: str, ext: str, what: str) -> str:
    """An existing file `name` (+ `ext` if missing) under ComfyUI's output folder, for reading back what a node
    wrote there (the same name rules as writing; a link out of the folder is refused)."""
    folder, file = output_file_path(name, ext, what)
    path = os.path.join(folder, file)
    if not os.path.isfile(path) or os.path.islink(path):
        raise PathRefused(f"{what} {name!r}: there is no such file in ComfyUI's output folder.")
    return path


def write_output_file(name: str, ext: str, write: Callable[[str], object], what: str = "save_as") -> str:
    """Write a new file `name` (+ `ext` if missing) under ComfyUI's output folder and return its path.

    `write(tmp_path)` writes the content to a temporary file beside the target. An existing file is never
    replaced: `name_00001<ext>`, `name_00002<ext>`, ... is used instead (the first free one is reserved
    atomically, so two runs never pick the same name)."""
    target = reserve_output_file(name, ext, what)
    folder = os.path.dirname(target)
    fd, tmp = tempfile.mkstemp(prefix=".omnivideo-", suffix=ext, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)  # replaces only the empty file reserved above
    except BaseException:
        for leftover in (tmp, target):
            if os.path.exists(leftover):
                os.unlink(leftover)
        raise
    return target


def reserve_output_file(name: str, ext: str, what: str = "save_as") -> str:
    """Create a new, empty file `name` (+ `ext` if missing) under ComfyUI's output folder and return its path, for
    a caller that replaces it (`write_output_file`); one that writes it in place takes `create_output_file`."""
    created = create_output_file(name, ext, what)
    created.file.close()
    return created.path


class NewOutputFile:
    """A file `create_output_file` made, open for writing through the descriptor that created it: what is put at
    its path afterwards (a symbolic link, another file) is never written, nor removed by `discard`."""

    def __init__(self, path: str, subfolder: str, file: BinaryIO):
        self.path = path
        self.subfolder = subfolder  # its folder relative to the output folder ("" at the top), as /view takes it
        self.file = file

    def discard(self) -> None:
        """Close the file and remove it, if its path still leads to it."""
        with self.file:
            ours = os.fstat(self.file.fileno())
            try:
                there = os.lstat(self.path)
            except FileNotFoundError:
                return
            if (there.st_dev, there.st_ino) == (ours.st_dev, ours.st_ino):
                os.unlink(self.path)


def create_output_file(name: str, ext: str, what: str = "save_as") -> NewOutputFile:
    """Create a new, empty file `name` (+ `ext` if missing) under ComfyUI's output folder, open for writing.

    An existing file is never replaced: the first free one of `name<ext>`, `name_00001<ext>`, ... is created
    atomically (O_EXCL, symlinks not followed), so two runs never pick the same name. The caller owns the file:
    it writes through `.file` (unbuffered: each write goes to the descriptor), never reopening the path, and calls
    `.discard()` if nothing comes of it."""
    root, folder, file = _output_target(name, ext, what)
    os.makedirs(folder, exist_ok=True)
    path, fd = _reserve(folder, file[: -len(ext)], ext, what, name)
    subfolder = "" if folder == root else os.path.relpath(folder, root)
    return NewOutputFile(path, subfolder, os.fdopen(fd, "wb", buffering=0))


def _reserve(folder: str, stem: str, ext: str, what: str, name: str) -> tuple[str, int]:
    """(path, descriptor open for writing) of the first free `stem<ext>`, `stem_00001<ext>`, ... in `folder`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for counter in range(MAX_COUNTER + 1):
        file = f"{stem}{ext}" if counter == 0 else f"{stem}_{counter:05d}{ext}"
        path = os.path.join(folder, file)
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            continue
        return path, fd
    raise PathRefused(f"{what} {name!r}: {MAX_COUNTER} numbered copies already exist; choose another name.")
