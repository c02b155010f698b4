"""The bytes of numpy arrays an object keeps alive: :func:`numpy_bytes`, for tests that bound what a trainer holds in
host memory (tests/test_shard_parameters.py: a parameter-sharded rank keeps no full copy of the parameters)."""

from __future__ import annotations

import gc
import types

import numpy as np

#: not followed: modules, classes and code reach the whole interpreter, not what an object holds
_SKIP = (types.ModuleType, type, types.CodeType, types.FrameType, types.BuiltinFunctionType, str)


def _owner(a: np.ndarray):
    """The object that owns ``a``'s buffer: ``a`` itself, the ndarray at the end of its chain of views, or the
    non-array buffer (bytes, a memory map) they were made from."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def numpy_bytes(root) -> int:
    """Bytes of the numpy buffers reachable from ``root`` through attributes, containers, bound methods and
    closures (not through modules, classes or a function's globals), each buffer counted once: a view counts its
    base's buffer (so a zero-stride placeholder of a large shape counts its one element), an array made from
    ``bytes`` the bytes. Torch tensors and onnxruntime values are not numpy arrays and are not counted."""
    seen: set[int] = set()
    total, stack = 0, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            owner = _owner(obj)
            if isinstance(owner, np.ndarray):
                if id(owner) not in seen or owner is obj:
                    seen.add(id(owner))
                    total += owner.nbytes
            else:
                stack.append(owner)
            continue
        if isinstance(obj, bytes | bytearray):
            total += len(obj)
            continue
        if isinstance(obj, types.FunctionType):  # its closure and defaults, not its module's globals
            stack.extend(gc.get_referents(*(obj.__closure__ or ())))  # (a cell's referent: its contents)
            stack.extend(obj.__defaults__ or ())
            continue
        if isinstance(obj, types.MethodType):
            stack.extend([obj.__self__, obj.__func__])
            continue
        stack.extend(gc.get_referents(obj))
    return total
