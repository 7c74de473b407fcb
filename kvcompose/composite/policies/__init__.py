"""Lookup policies: which children a node asks for a request, where each is asked, and how
their answers become the plan (the node's ``kvcompose.composite.lookup.Lookup`` asks, guards
and records; the policy decides).

- ``base``: the interface (``LookupPolicy``), and the candidates a node's choice names;
- ``first_longest``: one owner, the first hit or the longest;
- ``stitch``: one stitched load, each child asked where the segments before it end;
- ``fastest``: the plan with the least predicted time to first token, with its plan search
  and cost model;
- ``route``: route's choice of the one child to ask, by its rules;
- ``factory``: policy name → class (one registration per policy), and a node's policy built
  from its tree.

Chain, fan-out and route differ only in their candidates; a chain's ``policy`` names the
class. Each policy decides both ways a lookup runs, the general rule and its common case, so
a new policy is one module and one line in ``factory.POLICIES``. The modules import vLLM
only for type checking, and this package imports none of them: import the one you need.
"""
