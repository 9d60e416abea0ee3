"""Fresh ids: hex of the asked length, never handed out twice, in threads or in a forked child."""

from __future__ import annotations

import os
import re
import threading

from proxy.ids import random_hex


def test_ids_are_hex_digits_of_the_asked_length() -> None:
    for n_bytes in (1, 12, 16, 17, 32):
        assert re.fullmatch(rf"[0-9a-f]{{{2 * n_bytes}}}", random_hex(n_bytes))
    assert len(random_hex()) == 32


def test_no_id_repeats_across_batches() -> None:
    ids = [random_hex() for _ in range(5_000)] + [random_hex(12) for _ in range(5_000)]
    assert len(set(ids)) == len(ids)


def test_threads_never_share_an_id() -> None:
    taken: list[list[str]] = [[] for _ in range(4)]

    def take(into: list[str]) -> None:
        into.extend(random_hex() for _ in range(3_000))

    threads = [threading.Thread(target=take, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [one for into in taken for one in into]
    assert len(set(every)) == len(every) == 12_000


def test_a_forked_child_reads_its_own_ids() -> None:
    random_hex()  # the parent holds a batch now
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's)
        os.close(read)
        os.write(write, "".join(random_hex() for _ in range(64)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(child, 0)
    in_child = {text[at : at + 32] for at in range(0, len(text), 32)}
    in_parent = {random_hex() for _ in range(64)}
    assert len(in_child) == 64
    assert not in_child & in_parent
