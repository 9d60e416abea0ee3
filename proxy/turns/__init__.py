"""The turn core: a dialect-free request in, prompt ids planned, the engine called, the call recorded.

request.py holds the plain data, planning.py everything before the engine call, recording.py
everything after it, answer_text.py the sampled ids read as text; runner.py composes them.
"""

from proxy.turns.request import PreparedTurn, PromptPlan, TurnRequest, TurnResult
from proxy.turns.runner import TurnRunner

__all__ = ["PreparedTurn", "PromptPlan", "TurnRequest", "TurnResult", "TurnRunner"]
