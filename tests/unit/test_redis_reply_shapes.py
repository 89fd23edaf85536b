"""What the shared tier does with an ``MGET`` reply that is not what Redis answers (a proxy, a
misbehaving or hostile server): every key a miss, never an exception into the request (issue 64).

A RESP3 server on loopback, in this test's event loop (redis-py opens with ``HELLO 3``), that answers
every ``MGET`` with the reply under test and the client's other commands on connect with ``+OK``.
"""

from __future__ import annotations

import asyncio

import pytest

from service.http.cache.redis_store import RedisStore

KEYS = ["k1", "k2", "k3"]
REPLIES = {
    "short array": b"*1\r\n$3\r\nabc\r\n",
    "long array": b"*4\r\n$1\r\na\r\n$1\r\nb\r\n$1\r\nc\r\n$1\r\nd\r\n",
    "integer": b":3\r\n",
    "simple string": b"+OK\r\n",
    "null": b"_\r\n",
    "map": b"%1\r\n$2\r\nk1\r\n$2\r\nv1\r\n",
}
HELLO = b"%1\r\n$5\r\nproto\r\n:3\r\n"


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP array of bulk strings, as clients send commands."""
    count = int((await reader.readline())[1:])
    parts = []
    for _ in range(count):
        length = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(length + 2))[:-2])
    return parts


async def get_many_against(reply: bytes) -> list[bytes | None]:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                command = await read_command(reader)
                name = command[0].upper()
                writer.write(reply if name == b"MGET" else HELLO if name == b"HELLO" else b"+OK\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ValueError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisStore(f"redis://127.0.0.1:{port}/0", timeout_s=2.0, ttl_s=60)
    try:
        return await store.get_many(KEYS)
    finally:
        await store.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("shape", list(REPLIES))
def test_an_mget_reply_of_the_wrong_shape_is_a_miss_for_every_key(shape: str) -> None:
    assert asyncio.run(get_many_against(REPLIES[shape])) == [None, None, None]


def test_a_well_formed_reply_is_read_key_by_key() -> None:
    """The same server, answering as Redis does: the check above refuses only what is malformed."""
    reply = b"*3\r\n$2\r\nv1\r\n_\r\n$2\r\nv3\r\n"
    assert asyncio.run(get_many_against(reply)) == [b"v1", None, b"v3"]
