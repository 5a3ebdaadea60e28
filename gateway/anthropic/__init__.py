"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``), served by
the chat endpoint's machinery: a request is lowered to the chat request it stands for
(``lowering.py``, on the bodies of ``bodies.py`` and ``content.py``), and the answer is rendered
from the same ``Generation`` in Anthropic's shapes (``events.py``, ``answer.py``); errors in
Anthropic's shape (``errors.py``); the handlers in ``handlers.py``, the ``/openapi.json`` entries
in ``openapi.py`` and ``response_models.py``."""
