"""What the rendezvous store holds is sealed (issue 24 item 2): a pair's group meets only
through values a holder of the consumer's secret wrote under that very key, and queue
messages carry a MAC over their queue and a sequence that only grows."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from kvtransfer import DistBackend, Refusal, auth
from kvtransfer.backend import ChannelError
from kvtransfer.guard import RefusalCounts

HOST = "127.0.0.1"
SECRET = auth.new_secret()
CPU = torch.device("cpu")


def open_rank(backend: DistBackend, address, pair: str, rank: int, out: dict,
              counts: RefusalCounts | None = None, timeout_s: float = 10.0) -> None:
    try:
        out[rank] = backend.open_channel(address, pair, rank, CPU, HOST, timeout_s,
                                         secret=SECRET, counts=counts)
    except ChannelError as exc:
        out[rank] = exc


def test_a_pair_meets_through_sealed_values_and_a_moved_one_is_refused() -> None:
    server_side, peer = DistBackend(), DistBackend()
    address = server_side.listen(HOST)
    raw = dist.TCPStore(HOST, address.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    try:
        # A genuine pair: both ranks through sealed values, a tensor crosses.
        got: dict = {}
        ranks = [threading.Thread(target=open_rank, args=(b, address, "pair-x", r, got))
                 for r, b in ((0, peer), (1, server_side))]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join()
        assert not isinstance(got[0], ChannelError) and not isinstance(got[1], ChannelError)
        data = torch.arange(8, dtype=torch.float32)
        into = torch.zeros(8)
        recv = got[1].recv(into, 20)
        got[0].send(data, 20).wait(10)
        recv.wait(10)
        assert torch.equal(into, data)
        # What the store holds is not a gloo address anyone can read and race to.
        stored = raw.get("kvx/pg/pair-x/0/0")
        assert stored.startswith(auth.MAGIC) and HOST.encode() not in stored

        # Pair y: rank 0's value is replaced by pair x's (genuine, sealed, moved). Rank 1
        # refuses it rather than connecting to pair x's rank 0.
        late: dict = {}
        rank0 = threading.Thread(target=open_rank,
                                 args=(peer, address, "pair-y", 0, late, None, 3.0))
        rank0.start()
        raw.wait(["kvx/pg/pair-y/0/0"])
        raw.set("kvx/pg/pair-y/0/0", stored)
        counts = RefusalCounts()
        open_rank(server_side, address, "pair-y", 1, late, counts)
        rank0.join()
        assert isinstance(late[1], ChannelError) and "refused" in str(late[1])
        assert counts.snapshot()[Refusal.FORGED] == 1
    finally:
        for channel in got.values():
            if not isinstance(channel, ChannelError):
                channel.close()
        server_side.shutdown()


def test_values_bind_their_key_and_the_secret() -> None:
    sealed = auth.seal_value(SECRET, "kvx/pg/a/0/0", b"address")
    assert auth.open_value(SECRET, "kvx/pg/a/0/0", sealed) == b"address"
    for secret, key, value in ((SECRET, "kvx/pg/b/0/0", sealed),  # moved to another key
                               ("other", "kvx/pg/a/0/0", sealed),  # another consumer's
                               (SECRET, "kvx/pg/a/0/0", sealed[:-1]),  # truncated
                               (SECRET, "kvx/pg/a/0/0", b"plain"),
                               (SECRET, "kvx/pg/a/0/0", "\u00e9")):
        with pytest.raises(auth.AuthError) as err:
            auth.open_value(secret, key, value)
        assert err.value.kind == "forged"
    with pytest.raises(auth.AuthError) as err:
        auth.open_value(SECRET, "k", b"\0" * (auth.MAX_VALUE_BYTES + auth.VALUE_OVERHEAD + 1))
    assert err.value.kind == "oversize"


def test_a_stream_refuses_a_replay_and_a_message_moved_from_another_queue() -> None:
    sealer = auth.Sealer(SECRET, "kvx/p/rev")
    opener = auth.Opener(SECRET, "kvx/p/rev", max_bytes=64)
    first, second = sealer.seal(b"one"), sealer.seal(b"two")
    assert opener.open(first) == b"one" and opener.open(second) == b"two"
    for raw, kind in ((first, "replayed"),
                      (auth.Sealer(SECRET, "kvx/q/rev").seal(b"x"), "forged"),
                      (b"\0" * 200, "oversize"),
                      (second[:10], "forged")):
        with pytest.raises(auth.AuthError) as err:
            opener.open(raw)
        assert err.value.kind == kind
    assert opener.open(sealer.seal(b"three")) == b"three"
