"""``pdserve plan``: profile this model on this hardware with short real runs of a prefill and a
decode engine (profile_run.py drives them, measure.py is one role's run in its own process), then
hand the measured ``Profile`` to the planner's pure core (``shared/planner``) for the advice."""
