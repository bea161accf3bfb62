"""The one concurrency model of the blocking clients: the asyncio classes, run on a private
event loop in a daemon thread.

`AsyncClient`, `AsyncTrainerClient`, `AsyncFleet`, `AsyncBroadcast` and `Planner` are the
implementation. Each blocking class (`Client`, `TrainerClient`, `Fleet`, `Broadcast`,
`PlannerThread`) runs them on a `LoopThread`: its own (`LoopOwner`), or its maker's. `blocking(AsyncThing.method)` makes the blocking twin of an async method, with
the same parameters, defaults, overloads, return type and docstring, so no method is written
twice; `streaming` does the same for async iterators and `entering` for async context
managers, and `forwarded` makes an async class's method of its helper's. Imports neither torch
nor vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

P = ParamSpec("P")
T = TypeVar("T")
V = TypeVar("V")
CoreT = TypeVar("CoreT")
CoreT_co = TypeVar("CoreT_co", covariant=True)
OwnerT = TypeVar("OwnerT")
HelperT = TypeVar("HelperT")


class _End:
    """Stands for the end of a bridged async iterator (StopAsyncIteration does not cross tasks)."""


_END = _End()


async def _next(stream: AsyncIterator[T]) -> T | _End:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _settle(future: concurrent.futures.Future[T], task: asyncio.Future[T]) -> None:
    """Hand the outcome of `task` (on the loop) to the caller's `future` (any thread)."""
    if future.done():
        return
    if task.cancelled():
        future.cancel()
    elif (error := task.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(task.result())


async def _cancel(started: list[asyncio.Future[Any]]) -> None:
    """Cancel the task of an abandoned `run` and wait until it has finished."""
    for task in started:
        task.cancel()
    if started:
        await asyncio.wait(started)


class LoopThread:
    """An asyncio event loop on a daemon thread, for blocking callers on any thread.

    Everything an async object does (its gRPC channel, its tasks) happens on this one loop;
    the blocking methods only hand it coroutines and wait for their results.
    """

    def __init__(self, name: str = "enginectl-client") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._closing = False
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closing

    def run(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """Await `awaitable` on the loop; its result, or its exception raised here.

        If the caller stops waiting first (`timeout`: TimeoutError, or KeyboardInterrupt), the
        task is cancelled and has finished before this raises, so nothing runs on behind it.
        """
        if self._closing or threading.current_thread() is self._thread:
            if isinstance(awaitable, Coroutine):
                awaitable.close()  # it will never run: no "never awaited" warning
            raise RuntimeError(
                "the client is closed"
                if self._closing
                else "a blocking client method was called on its own event loop; use the async client"
            )
        # The result crosses threads through `future`, made before anything is scheduled, so a
        # KeyboardInterrupt at any point of this method still finds the task to cancel: the
        # loop runs callbacks in order, so `start` has run before `_cancel` does.
        started: list[asyncio.Future[T]] = []
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            task = asyncio.ensure_future(awaitable)
            started.append(task)
            task.add_done_callback(functools.partial(_settle, future))

        try:
            self._loop.call_soon_threadsafe(start)
            return future.result(timeout)
        except BaseException:
            if not future.done():
                asyncio.run_coroutine_threadsafe(_cancel(started), self._loop).result()
                if not started and isinstance(awaitable, Coroutine):
                    awaitable.close()  # interrupted before it was scheduled: it never runs
            raise

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Call the plain function `fn` on the loop's thread (to read state the loop owns)."""

        async def on_loop() -> T:
            return fn(*args, **kwargs)

        return self.run(on_loop())

    def iterate(self, stream: AsyncIterator[T]) -> Generator[T, None, None]:
        """A blocking iterator over `stream`, reading one item per step (no read-ahead, so a
        slow reader slows the stream, as with the async one). Closing it, or leaving a for
        loop early, closes `stream` on the loop."""
        try:
            while not isinstance(item := self.run(_next(stream)), _End):
                yield item
        finally:
            if self._closing:
                pass  # the loop closed its async generators when it stopped
            elif threading.current_thread() is self._thread:  # collected on the loop itself
                self._loop.create_task(_aclose(stream))
            else:
                self.run(_aclose(stream))

    @contextlib.contextmanager
    def enter(self, manager: AbstractAsyncContextManager[T]) -> Iterator[T]:
        """A blocking context manager around the async `manager`: entered and exited on the loop."""
        value = self.run(manager.__aenter__())
        try:
            yield value
        except BaseException as exc:
            if not self.run(manager.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self.run(manager.__aexit__(None, None, None))

    def close(self) -> None:
        """Stop the loop and its thread (once the owner closed what runs on it). Idempotent."""
        if self._closing:
            return
        self.run(self._loop.shutdown_asyncgens())
        self._closing = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Closes(Protocol):
    async def close(self) -> None: ...


ClosesT = TypeVar("ClosesT", bound=_Closes)


class LoopOwner(Generic[ClosesT]):
    """A blocking class that runs its async object on a LoopThread of its own (Client,
    Fleet): the object is made on the loop, closed on it with `close()`, which also stops
    the loop; a context manager."""

    def __init__(self, name: str, make: Callable[[], Awaitable[ClosesT]]) -> None:
        self._loop = LoopThread(name)
        try:
            self._core = self._loop.run(make())
        except BaseException:
            self._loop.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel(s) and stop the loop thread. Idempotent."""
        if self._loop.closed:
            return
        try:
            self._loop.run(self._core.close())
        finally:
            self._loop.close()


class Facade(Protocol[CoreT_co]):
    """A blocking class: the async object it fronts (`_core`) and the loop that runs it."""

    @property
    def _core(self) -> CoreT_co: ...

    @property
    def _loop(self) -> LoopThread: ...


@overload
def blocking(
    method: Callable[Concatenate[CoreT, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Facade[CoreT], P], T]: ...


@overload
def blocking(
    method: Callable[Concatenate[CoreT, P], Coroutine[Any, Any, T]],
    view: Callable[[LoopThread, T], V],
) -> Callable[Concatenate[Facade[CoreT], P], V]: ...


def blocking(
    method: Callable[Concatenate[CoreT, P], Coroutine[Any, Any, T]],
    view: Callable[[LoopThread, T], Any] | None = None,
) -> Callable[Concatenate[Facade[CoreT], P], Any]:
    """The blocking twin of an async method, for the body of a Facade class:

        get_weight_version = blocking(AsyncClient.get_weight_version)

    With `view`, the result is wrapped in it (a blocking view of a returned async object).
    """

    @functools.wraps(method)
    def call(self: Facade[CoreT], /, *args: P.args, **kwargs: P.kwargs) -> Any:
        result = self._loop.run(method(self._core, *args, **kwargs))
        return result if view is None else view(self._loop, result)

    return call


def forwarded(
    helper: Callable[[OwnerT], HelperT], method: Callable[Concatenate[HelperT, P], Coroutine[Any, Any, T]]
) -> Callable[Concatenate[OwnerT, P], Coroutine[Any, Any, T]]:
    """`method` of a helper as an async method of the class that holds the helper, called on
    `helper(self)`: the same parameters, defaults, return type and docstring, written once (on
    the helper). For the body of that class:

        start_weight_update = forwarded(_transfer_of, FleetTransfer.start_weight_update)
    """

    @functools.wraps(method)
    async def call(self: OwnerT, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await method(helper(self), *args, **kwargs)

    return call


def streaming(
    method: Callable[Concatenate[CoreT, P], AsyncIterator[T]],
) -> Callable[Concatenate[Facade[CoreT], P], Generator[T, None, None]]:
    """The blocking twin of an async-iterator method: a generator (see LoopThread.iterate)."""

    @functools.wraps(method)
    def call(self: Facade[CoreT], /, *args: P.args, **kwargs: P.kwargs) -> Generator[T, None, None]:
        return self._loop.iterate(method(self._core, *args, **kwargs))

    return call


def entering(
    method: Callable[Concatenate[CoreT, P], AbstractAsyncContextManager[T]],
) -> Callable[Concatenate[Facade[CoreT], P], AbstractContextManager[T]]:
    """The blocking twin of an async-context-manager method (see LoopThread.enter)."""

    @functools.wraps(method)
    def call(self: Facade[CoreT], /, *args: P.args, **kwargs: P.kwargs) -> AbstractContextManager[T]:
        return self._loop.enter(method(self._core, *args, **kwargs))

    return call
