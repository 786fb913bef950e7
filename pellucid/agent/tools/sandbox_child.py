"""The sandbox child's bootstrap: set limits, install the audit hook, run main.py as __main__.

python_sandbox.py runs this file's text with `python -I -c` in the sandbox's temp dir. The code
under test shares this interpreter, so the hook trusts nothing it can change: it reads no
globals (every builtin, C function and setting is bound in its closure, which nothing can
reach), calls no Python-level library code (its realpath is its own, from posix.lstat and
posix.readlink), and copies str/int subclasses to exact types before comparing them. Nothing
here may be imported by pellucid itself.
"""

import builtins
import os
import posix
import resource
import sys
import types


def _realpath(path, cwd, lstat, readlink, oserror):
    """os.path.realpath from its arguments alone: posixpath and builtins can be monkeypatched."""
    if not path.startswith("/"):
        path = cwd + "/" + path
    todo = path.split("/")
    todo.reverse()
    out, hops = "", 0
    while todo:
        name = todo.pop()
        if name == "" or name == ".":
            continue
        if name == "..":
            out = out[: out.rfind("/")]
            continue
        here = out + "/" + name
        try:
            mode = lstat(here).st_mode
        except oserror:
            mode = 0  # missing: the rest is taken as written
        if mode & 0o170000 != 0o120000:
            out = here
            continue
        hops += 1
        if hops > 40:
            return "/<symlink loop>"
        target = readlink(here).split("/")
        if target[0] == "":
            out = ""
        target.reverse()
        todo.extend(target)
    return out or "/"


def _make_hook(tmp, read_roots):
    lstat, stat, readlink, getcwd = posix.lstat, posix.stat, posix.readlink, posix.getcwd
    type_, issubclass_, len_ = type, issubclass, len
    str_, bytes_, int_ = str, bytes, int
    str_copy, int_copy, decode = str.__str__, int.__index__, bytes.decode
    denied, import_error, oserror = PermissionError, ImportError, OSError
    realpath, fsenc = _realpath, sys.getfilesystemencoding()
    tmp_slash = tmp + "/"
    roots = tuple((r, r + "/") for r in read_roots)
    devices = frozenset({"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"})
    R, W = "read", "write"
    # Only immutable values here: a traceback can reach the hook's frame, and its f_locals.
    # These are C-level events, whose path arguments are already converted to str or bytes.
    reads = frozenset({"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"})
    writes = frozenset(
        {
            "os.chdir",
            "os.chmod",
            "os.chown",
            "os.chflags",
            "os.mkdir",
            "os.rmdir",
            "os.remove",
            "os.truncate",
            "os.utime",
            "os.setxattr",
            "os.removexattr",
        }
    )
    reasons = (
        (
            "starting processes",
            (
                "os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty "
                "os.startfile subprocess.Popen pty.spawn"
            ),
        ),
        ("sending signals", "os.kill os.killpg signal.pthread_kill"),
        ("creating links", "os.link os.symlink"),
        ("changing resource limits", "resource.setrlimit resource.prlimit"),
        (
            "opening databases (sqlite can attach any file)",
            "sqlite3.connect sqlite3.enable_load_extension sqlite3.load_extension",
        ),
        (
            "tracing, heap walking and subinterpreters (they can switch the sandbox off)",
            (
                "sys.settrace sys.setprofile gc.get_objects gc.get_referrers gc.get_referents "
                "cpython.PyInterpreterState_New"
            ),
        ),
        ("opening a browser", "webbrowser.open"),
    )
    refused = frozenset(" ".join(events for _, events in reasons).split())
    no_import = frozenset(
        {
            "ctypes",
            "_ctypes",
            "_posixsubprocess",
            "_posixshmem",
            "_multiprocessing",
            "_ssl",
            "_dbm",
            "_gdbm",
            "readline",
            "_curses",
            "_curses_panel",
            "_tkinter",
            "_xxsubinterpreters",
            "_xxinterpchannels",
            "_interpreters",
        }
    )

    def hook(event, args):
        if event == "open":
            flags = args[2]
            flags = int_copy(flags) if issubclass_(type_(flags), int_) else 3
            # Read-only means O_RDONLY without O_CREAT (0o100) or O_TRUNC (0o1000).
            checks = ((0, R if flags & 3 == 0 and flags & 0o1100 == 0 else W),)
        elif event in reads:
            checks = ((0, R),)
        elif event in writes:
            checks = ((0, W),)
        elif event == "os.rename":
            checks = ((0, W), (1, W))
        else:
            checks = None
        if checks is not None:
            for index, kind in checks:
                path = args[index] if index < len_(args) else None
                if path is None or issubclass_(type_(path), int_):
                    continue  # a file descriptor, or the current directory
                if issubclass_(type_(path), str_):
                    path = str_copy(path)
                elif issubclass_(type_(path), bytes_):
                    path = decode(path, fsenc, "surrogateescape")
                else:
                    raise denied(f"sandbox: {event} needs a str or bytes path")
                # A relative path may be resolved against a dir_fd the hook cannot see; without
                # "..", and with no symlinks in the temp dir, it stays below that directory.
                if not path.startswith("/") and ".." in path.split("/"):
                    raise denied(
                        f"sandbox: '..' in the relative path {path!r}; use an absolute path"
                    )
                full = realpath(path, getcwd(), lstat, readlink, oserror)
                if full in devices:
                    continue
                try:
                    mode = stat(full).st_mode & 0o170000
                except oserror:
                    mode = 0
                if full == tmp or full.startswith(tmp_slash):
                    if mode == 0o020000 or mode == 0o060000:  # a device node made with os.mknod
                        raise denied(f"sandbox: opening the device {path!r} is not allowed")
                    continue
                if kind == W:
                    raise denied(
                        f"sandbox: cannot write {path!r}: only the current directory is writable"
                    )
                for root, root_slash in roots:
                    if full == root or full.startswith(root_slash):
                        break
                else:
                    raise denied(
                        f"sandbox: cannot read {path!r}: only the current directory and Python's "
                        "own files are readable"
                    )
                if event == "open" and mode == 0o040000:
                    # A directory fd would let os.open(..., dir_fd=fd) write below it.
                    raise denied(f"sandbox: opening the directory {path!r} is not allowed")
        elif event in refused:
            for reason, events in reasons:
                if event in events.split():
                    raise denied(f"sandbox: {reason} is not allowed ({event})")
        elif (
            event == "socket.__new__"
            and issubclass_(type_(args[1]), int_)
            and int_copy(args[1]) == 1
        ):
            pass  # an AF_UNIX socket, for asyncio's socketpair; its connect and bind are refused
        elif event.startswith("socket."):
            raise denied(f"sandbox: network access is not allowed ({event})")
        elif event.startswith("ctypes."):
            raise denied(f"sandbox: ctypes is not allowed ({event})")
        elif event == "import":
            # An extension's init symbol is PyInit_<last part of the name>: "x._ctypes" is _ctypes.
            name = str_copy(args[0]).rpartition(".")[2]
            if name in no_import or name.startswith("_test"):
                raise import_error(f"sandbox: the module {name!r} is not available")
        elif event == "object.__setattr__" and args[0] is realpath:
            raise denied("sandbox: changing the sandbox's own functions is not allowed")

    return hook


def _landlock(tmp, read_roots):
    """Kernel-enforced confinement (Landlock, Linux 5.13+) for when the hook is bypassed: read
    Python's files and the shared libraries extensions load, do anything in tmp but make links
    or devices, execute nothing; with ABI 4+ no TCP, with ABI 6+ no signals out."""
    import ctypes
    import struct

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
        if abi < 1:
            return
        fs = (1 << 13) - 1  # EXECUTE ... MAKE_SYM
        fs |= (
            (1 << 13 if abi >= 2 else 0)
            | (1 << 14 if abi >= 3 else 0)
            | (1 << 15 if abi >= 5 else 0)
        )
        attr = struct.pack("QQQ", fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
        attr = attr[: 8 if abi < 4 else 16 if abi < 6 else 24]  # the struct grew with the ABI
        ruleset = libc.syscall(444, attr, len(attr), 0)
        if ruleset < 0:
            return
        read, file_rights = 1 << 2 | 1 << 3, 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15
        in_tmp = fs & ~(1 << 0 | 1 << 6 | 1 << 11 | 1 << 12)  # not EXECUTE, MAKE_CHAR/BLOCK/SYM
        libs = ["/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache"]
        devices = ["/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"]
        rules = [(tmp, in_tmp)] + [(p, read) for p in read_roots + libs]
        for path, access in rules + [(d, 1 << 1 | 1 << 2) for d in devices]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            if not os.path.isdir(path):
                access &= file_rights
            libc.syscall(445, ruleset, 1, struct.pack("=Qi", access & fs, fd), 0)  # PATH_BENEATH
            os.close(fd)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, required to restrict oneself
        libc.syscall(446, ruleset, 0)  # landlock_restrict_self
        os.close(ruleset)
    finally:
        # Forget ctypes, so that the code cannot import it from sys.modules past the hook.
        for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]


def _main():
    memory_mb, cpu_s, file_mb, kernel, audit = (int(a) for a in sys.argv[1:6])
    limits = {
        resource.RLIMIT_AS: (memory_mb * 2**20,) * 2,
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),  # SIGXCPU first: a clearer death than SIGKILL
        resource.RLIMIT_FSIZE: (file_mb * 2**20,) * 2,
        resource.RLIMIT_NPROC: (0, 0),  # no fork, for any uid but root (which the kernel exempts)
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, limit in limits.items():
        resource.setrlimit(which, limit)
    tmp = os.path.realpath(os.getcwd())
    roots = [os.path.realpath(p) for p in sys.path if p]
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    if kernel:
        _landlock(tmp, roots)
    # subprocess imports fine, but its fork_exec is a stub: Popen is refused by the hook anyway,
    # and the real _posixsubprocess, which would fork unaudited, cannot be imported any more.
    stub = types.ModuleType("_posixsubprocess")

    def fork_exec(*args):
        raise PermissionError("sandbox: starting processes is not allowed")

    stub.fork_exec = fork_exec
    sys.modules["_posixsubprocess"] = stub
    sys.path.insert(0, tmp)
    sys.argv = ["main.py"]
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = "main.py", builtins
    sys.modules["__main__"] = main
    if audit:
        sys.addaudithook(_make_hook(tmp, roots))
    exec(code, main.__dict__)  # noqa: S102 - running the model's program is this file's job


if __name__ == "__main__":  # run as `python -c` text by python_sandbox.py
    _main()
