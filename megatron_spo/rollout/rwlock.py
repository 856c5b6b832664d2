"""An asyncio reader/writer lock with writer preference: SGLang's model-update lock rule.

Every /generate holds a reader lock for its whole lifetime; a weight update on an engine that is not paused
takes the writer lock, so it waits for every request in flight to finish, and requests that arrive while a
writer waits queue behind it (sglang/srt/utils/aio_rwlock.py in sglang 0.5.23; tests run both on the same
interleavings).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class RWLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    async def acquire_reader(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1

    async def release_reader(self) -> None:
        async with self._cond:
            self._readers -= 1
            if not self._readers:
                self._cond.notify_all()

    async def acquire_writer(self) -> None:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
                self._writer = True
            finally:
                self._writers_waiting -= 1
                if not self._writer:  # cancelled while waiting: readers queued behind it may go
                    self._cond.notify_all()

    async def release_writer(self) -> None:
        async with self._cond:
            self._writer = False
            self._cond.notify_all()

    async def is_locked(self) -> bool:
        async with self._cond:
            return self._writer or self._readers > 0

    @property
    def readers(self) -> int:
        return self._readers

    @asynccontextmanager
    async def reader(self):
        await self.acquire_reader()
        try:
            yield
        finally:
            await self.release_reader()

    @asynccontextmanager
    async def writer(self):
        await self.acquire_writer()
        try:
            yield
        finally:
            await self.release_writer()
