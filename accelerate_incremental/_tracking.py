"""Route a prepared DataLoader's own iteration (``for batch in loader``) through a function.

A ``for`` loop looks ``__iter__`` up on the type, never on the instance, so the loader's class is
switched to a subclass that only overrides ``__iter__`` (one per loader class, created once). The
object keeps its identity, attributes, ``len``, ``isinstance`` and pickling (Accelerate's loaders
pickle as their own class); Accelerate's loaders report ``DataLoader`` as ``__class__`` and still
do. :func:`own_iter` is the loader's original iteration, for the function to read from;
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


def _subclass(cls: type) -> type:
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        namespace = {"__iter__": _tracked_iter, "__module__": cls.__module__}
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
