"""Fair sharing in a worker process that holds several models (service/worker/turns.py): batches take
turns first come, first served, so a model that keeps having work cannot take the process again
ahead of one already waiting."""

from __future__ import annotations

import threading

from service.worker.turns import ModelTurns
from tests.worker_hold import wait_until


def test_a_hot_model_that_asks_again_at_once_waits_behind_a_cold_one() -> None:
    turns = ModelTurns()
    order: list[str] = []
    cold_asked = threading.Event()

    def hot() -> None:
        for batch in range(3):
            with turns.turn():
                order.append("hot")
                if batch == 0:
                    cold_asked.set()
                    wait_until(
                        lambda: turns.waiting == 1, "the cold model waits"
                    )  # the cold model waits for this batch to end
            # and asks again at once, as a loop with a full queue does

    def cold() -> None:
        cold_asked.wait()
        with turns.turn():
            order.append("cold")

    threads = [threading.Thread(target=hot), threading.Thread(target=cold)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert order == ["hot", "cold", "hot", "hot"]


def test_turns_are_handed_over_in_the_order_they_were_asked_and_one_at_a_time() -> None:
    turns = ModelTurns()
    order: list[int] = []
    inside = []
    first_in = threading.Event()
    release_first = threading.Event()

    def model(number: int) -> None:
        with turns.turn():
            inside.append(number)
            assert len(inside) == 1, "two batches ran at once"
            order.append(number)
            if number == 0:
                first_in.set()
                release_first.wait()
            inside.remove(number)

    threads = [threading.Thread(target=model, args=(0,))]
    threads[0].start()
    first_in.wait()
    for number in range(1, 6):
        thread = threading.Thread(target=model, args=(number,))
        thread.start()
        threads.append(thread)
        wait_until(
            lambda number=number: turns.waiting == number, f"{number} models wait"
        )  # each asks after the one before
    release_first.set()
    for thread in threads:
        thread.join(10)
    assert order == [0, 1, 2, 3, 4, 5] and turns.waiting == 0


def test_an_error_inside_a_turn_hands_it_on() -> None:
    turns = ModelTurns()
    try:
        with turns.turn():
            raise RuntimeError("the engine failed")
    except RuntimeError:
        pass
    done = threading.Event()
    threading.Thread(target=lambda: (turns.turn().__enter__(), done.set())).start()
    assert done.wait(5), "a failed batch kept the process's turn"
