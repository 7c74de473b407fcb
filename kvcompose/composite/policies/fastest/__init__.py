"""``policy: fastest``: the plan with the least predicted time to first token.

- ``policy``: the policy (``FastestLookup``): every child asked at the local hit, the
  cheapest plan taken, its loads expected and timed;
- ``search``: the plan search (``Planner``);
- ``costs``: the cost model (``Costs``): each child's load line, the engine's prefill speed,
  the loads awaiting their times.
"""
