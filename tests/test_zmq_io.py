"""zmq_io on real sockets: the same messages as pyzmq's multipart calls, and readable() re-arms
the FD."""

import select
import time

import pytest
import zmq

from lmcache_mp.zmq_io import readable, recv_frames, send_frames

MESSAGES = [[b"one"], [b"", b""], [b"id", b"OP", b"\x00" * 70_000],
            [bytes([i]) * i for i in range(9)]]


@pytest.fixture
def pair(tmp_path):
    context = zmq.Context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
    url = f"ipc://{tmp_path}/s"
    router.bind(url)
    dealer.connect(url)
    yield router, dealer
    router.close()
    dealer.close()
    context.term()


def wait_readable(sock, timeout=5.0):
    end = time.monotonic() + timeout
    while not readable(sock):
        assert time.monotonic() < end, "nothing arrived"
        time.sleep(0.001)


def test_frames_go_and_come_as_pyzmqs_multipart_calls_send_them(pair):
    router, dealer = pair
    for message in MESSAGES:
        send_frames(dealer, message)
        wait_readable(router)
        identity, *received = recv_frames(router)
        assert received == message
        dealer.send_multipart(message)
        wait_readable(router)
        assert recv_frames(router) == [identity, *message]
        send_frames(router, [identity, *message])
        assert dealer.recv_multipart() == message
    assert not readable(router)
    with pytest.raises(zmq.Again):
        recv_frames(router)


def test_readable_rearms_the_edge_triggered_fd(pair):
    router, dealer = pair
    fd = router.getsockopt(zmq.FD)
    assert not readable(router)
    dealer.send_multipart([b"a"])
    # The FD signals once something arrived after the last readable(): select() wakes.
    assert select.select([fd], [], [], 5.0)[0] == [fd]
    wait_readable(router)
    recv_frames(router)
    assert not readable(router)
    dealer.send_multipart([b"b"])
    assert select.select([fd], [], [], 5.0)[0] == [fd]
