"""The gateway's side of a request in flight on the bus.

Life cycle of a request, as the gateway sees it

0. Admitted (HTTP): ``gateway/serving.py:serve_generation`` holds the client's x-request-id in
   ``gateway/app_state.py:Admissions.admit`` (409 for an id in flight, 503 when full) until the
   answer is sent; ``gateway/generation.py:Generation`` then asks ``Dispatcher.generate`` for
   the tokens of each prompt. One admitted request may be several on the bus (a prompt array).

1. Routed: ``dispatcher.py:Dispatcher.generate``
   a. fixes a seed for sampling without one (``legs.py:with_fixed_seed``: a migration then
      continues exactly), gives the request a bus id of its own (``legs.py:new_bus_id``) and
      refuses what the wire would drop (``Dispatcher._check_wire``: ``NotSendable``);
   b. builds the ``BusRequest`` (``bus_request.py``) under the ``Limits`` of the moment
      (``limits.py``) and routes its bus id to it (``Dispatcher._tracking``);
   c. picks the path (``Dispatcher._route``, the ``route`` span): a prefill worker first, or -
      for a short prompt or with no prefill worker alive - straight to a decode worker that
      prefills locally (step 4). No decode worker at all: ``NoWorker`` (503), nothing sent.

2. Prefill sent: ``prefill_stage.py:PrefillStage.prefill``
   a. ``Router.pick_prefill`` picks a worker, ``_prefill_on`` sends it the ``PrefillRequest``
      (``outbox.py:Outbox.send``) and waits for its answer, within ``--prefill-timeout``;
   b. a worker that leaves, refuses (overloaded, draining) or may have lost the request in a
      reconnect is replaced by another (``PREFILL_ATTEMPTS``); none left: step 4 prefills
      locally. However an attempt ends, its work stops counting on the worker
      (``Router.prefill_done``);
   c. streamed KV (``--kv-stream-threshold``): a long prompt's worker answers early, when the
      pass that completes it starts, with the handle of KV it is still computing and no token
      (``prefill_stage.py:streamed``; the worker side is ``services/prefill/worker.py``). If a
      decode worker can pull it so, the request goes on to step 4 at once and the first token
      arrives there (``PrefillStage._streamed_first``).

3. First token: ``PrefillStage._first_token`` records it (``delivery.py:Delivered``) and
   ``generate`` yields it at once: the time to first token. The KV handle goes on to step 4;
   a request already finished at its first token releases the lease (``Outbox.release_stale``).

4. Decode leg(s): ``bus_request.py:BusRequest.decode``
   a. the first leg (``legs.py:Leg``: one ``DecodeRequest``, under the request's own bus id, with
      the KV handle or none) goes to the decode worker ``Router.pick_decode`` picks
      (``BusRequest._send_leg``), and its bus id is routed to the request;
   b. ``Dispatcher._on_message`` hands each ``TokenItem`` to its request (``BusRequest.put``);
      ``decode`` holds it against what was delivered (``stream_check.py:screen``: replays are
      dropped, a gap has the leg checked) and yields the rest (``BusRequest._on_item``);
   c. a worker that refuses before its first token hands the leg to another
      (``DECODE_ATTEMPTS``), which prefills locally.

5. Migration, on worker loss or reconnect: ``departures.py:Departures`` hears of it and puts a
   notice (``queue_items.py``) on the queue of each request concerned: those that wait on that
   worker, or all of them when our own bus reconnected
   a. a worker gone (``WorkerLeft``): a prefill on it is retried elsewhere (step 2b), decode legs
      on it migrate at once (``BusRequest._migrate``);
   b. a worker whose NATS connection broke (``WorkerRejoined``), or our own bus reconnecting
      (``BusReconnected``): a prefill is retried, each decode leg concerned is checked
      (``stream_check.py``: the worker replays, then says where the stream stands); those that
      lost tokens, or go unanswered, migrate (reason ``bus_reconnect``);
   c. a migration re-plans the open choices from the delivered tokens (``legs.py:replan``),
      sends them to live decode workers - after our reconnect, only to workers heard since
      (``Departures.recovered``) - and cancels the old legs there, again if their worker turns
      up (``Departures.abandon``, ``abandoned_legs.py``); at most ``--max-migrations`` times.

6. Ending or cancel: the request is over when no choice is open (``delivery.py:OpenChoices``),
   or when its consumer closes the stream (client gone, stop string) or a fault ends it
   (``faults.py``: ``StageTimeout``, ``WorkerFailure``, ...). ``Dispatcher._tracking`` is its one
   way out: every bus id still routed to it is dropped (``Dispatcher.unregister``, which also
   ends its decode load on the router) and, unless it finished normally, cancelled on the
   workers (``Outbox.cancel``, spawned so that it outlives the cancelled handler). A consumer
   that stops one choice of several cancels only that one (``BusRequest._cancel_choice``). A
   prefill answer that arrives after its request ended has its lease released
   (``Dispatcher._deliver``). Then ``Admissions`` lets the x-request-id go.

Every wait has a deadline that follows progress (``bus_request.py``), and each worker enforces a
request's ``deadline`` until its first token only.

Who owns what. Each fact about a request in flight has one owner.

- ``Dispatcher._pending`` (bus id -> request) is the one routing table: where the inbox
  delivers, whom ``Departures`` tells of departures and reconnects, and what is dropped - and
  cancelled, unless it finished - when the request ends (``_tracking``; a leg that ends earlier
  leaves through ``unregister``).
- The ``BusRequest`` owns its progress: its stage, deadlines and queue, its prefill worker and
  legs (their workers are the ones it is ``watching``), its choices still open and what its
  consumer has (``Delivered``: what a migration replays). It reaches the rest only through its
  ``RequestPort`` (``port.py``).
- ``Departures`` owns what the bus connection's history implies: the bus epoch (reconnects so
  far), the recovery window after ours, and the legs migrated away (``AbandonedLegs``).
- ``Outbox`` owns the sends still under way that outlive their request.
- The router (``gateway/router.py``) keeps only load: what this gateway sent or runs on each
  worker, and per bus id where that was counted, to take it off there (``prefill_done``, called
  by the request's prefill attempt; ``decode_done``, by ``Dispatcher.unregister``).
- ``app_state.Admissions`` admits HTTP requests by the client's x-request-id, and
  ``Gateway.admitted_count`` counts them; the bus never sees that id alone.
"""
