"""Reward functions for the RewardPool tests, in a module that spawned workers can import."""

import math
import os
import time


def exact(response: str, answer: str) -> float:
    """1.0 when the response equals the answer."""
    return float(response == answer)


def raises(response: str, answer: str) -> float:
    raise ValueError(f"cannot score {response!r}")


def hangs(response: str, answer: str) -> float:
    time.sleep(3600)
    return 1.0


def scripted(response: str, answer: str):
    """Misbehaves as the response says ("raise", "hang", "nan", "text", "die"), else `exact`."""
    actions = {
        "raise": lambda: raises(response, answer),
        "hang": lambda: hangs(response, answer),
        "nan": lambda: math.nan,
        "text": lambda: "1.0",
        "die": lambda: os._exit(3),
    }
    return actions.get(response, lambda: exact(response, answer))()


def _failing_warmup() -> None:
    raise RuntimeError("warmup exploded")


def broken_warmup(response: str, answer: str) -> float:
    """Resolves fine in the parent; its workers fail in warmup."""
    return 1.0


broken_warmup.warmup = _failing_warmup

NOT_A_FUNCTION = 3
