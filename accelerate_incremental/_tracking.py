"""Route a prepared DataLoader's own iteration (``for batch in loader``) through a function.

A ``for`` loop looks ``__iter__`` up on the type, never on the instance, so the loader's class is
switched to a subclass that only overrides ``__iter__`` (one per loader class, created once). The
object keeps its identity, attributes, ``len`` and ``isinstance``; Accelerate's loaders report
``DataLoader`` as ``__class__`` and still do. Pickled or copied, a tracked loader is one of its
original class, untracked (the tracking function, bound to the checkpointer, stays behind).
:func:`own_iter` is the loader's original iteration, for the function to read from;
:func:`untrack` switches the class back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

_ATTR = "_incremental_epoch"
_SUBCLASSES: dict[type, type] = {}  # a loader class -> its tracked subclass
# object's own __class__ setter: Accelerate's loaders define __class__ as a read-only property.
_SET_CLASS = vars(object)["__class__"].__set__


def _tracked_iter(self: Any) -> Iterator[Any]:
    epoch: Callable[[], Iterator[Any]] = vars(self)[_ATTR]
    return epoch()


def _tracked_reduce_ex(self: Any, protocol: Any) -> Any:
    """The loader's own reduction (its class's), as its original class without the tracking."""
    sub = type(self)
    base = sub.__bases__[0]
    reduce_ex: Any = base.__reduce_ex__  # the function (object's, unless the class has its own)
    reduced = reduce_ex(self, protocol)
    if isinstance(reduced, str):
        return reduced
    parts = list(reduced)
    if parts[0] is sub:
        parts[0] = base
    if parts[1] and parts[1][0] is sub:  # copyreg.__newobj__(cls, ...)
        parts[1] = (base, *parts[1][1:])
    if len(parts) > 2:
        parts[2] = _untracked_state(parts[2])
    return tuple(parts)


def _untracked_state(state: Any) -> Any:
    if isinstance(state, dict) and _ATTR in state:
        return {key: value for key, value in state.items() if key != _ATTR}
    if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
        return (_untracked_state(state[0]), state[1])
    return state


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {
            "__iter__": _tracked_iter,
            "__reduce_ex__": _tracked_reduce_ex,
            "__module__": cls.__module__,
        }
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
        sub.__qualname__ = cls.__qualname__
    return sub


def is_tracked(loader: Any) -> bool:
    return type(loader) in _SUBCLASSES.values() and _ATTR in vars(loader)


def track(loader: Any, epoch: Callable[[], Iterator[Any]]) -> None:
    """Make ``iter(loader)`` return ``epoch()``.

    Raises:
        TypeError: the loader's class cannot be switched (slots or a built-in layout).
    """
    if is_tracked(loader):
        vars(loader)[_ATTR] = epoch
        return
    try:
        vars(loader)[_ATTR] = epoch
        _SET_CLASS(loader, _subclass(type(loader)))
    except TypeError as exc:
        vars(loader).pop(_ATTR, None)
        raise TypeError(
            f"cannot track the position of a {type(loader).__qualname__} (its class cannot be "
            f"extended: {exc}); iterate it through checkpointer.iterate(loader) instead"
        ) from exc


def untrack(loader: Any) -> None:
    if is_tracked(loader):
        _SET_CLASS(loader, type(loader).__bases__[0])
        del vars(loader)[_ATTR]


def own_iter(loader: Any) -> Iterator[Any]:
    """The loader's own iteration, whether or not it is tracked."""
    cls = type(loader)
    if cls in _SUBCLASSES.values():
        cls = cls.__bases__[0]
    iterator: Iterator[Any] = cls.__iter__(loader)
    return iterator
