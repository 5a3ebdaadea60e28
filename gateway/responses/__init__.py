"""OpenAI's Responses API (``/v1/responses``), converted at the edge to the chat endpoint's
request: ``bodies.py`` and ``items.py`` validate a request, ``conversation.py`` lowers its items
(after a stored conversation's) to chat messages served by ``gateway/prepare.py`` like any
chat, ``output.py`` turns the generated pieces into output items and stream events,
``answer.py`` answers (whole or streamed) and stores, ``handlers.py`` holds the endpoints, and
``store.py`` / ``jetstream_store.py`` keep stored responses in a NATS JetStream KV bucket, where
every gateway replica finds them."""
