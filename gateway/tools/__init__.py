"""Tool calling (OpenAI ``tools`` / ``tool_choice``): the request side (``setup.py``, the prompt
and the grammar), and the response side (parsers and the streamed deltas of ``tool_calls``)."""
