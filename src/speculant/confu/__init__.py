"""ConFu (Qin, Goel, Gagrani et al. 2026, "ConFu: Contemplate the Future for Better Speculative Sampling"): its
parts, and why each lives where it does.

An EAGLE-3 feature drafter that also reads a *future vector*: the target's final state for a masked contemplate
token that rides in the verification forward, reading the context and a learned soft prompt. The target's output is
untouched, so verification stays exact. ConFu has three parts, each at the layer whose generic code needs it:

- :mod:`speculant.models.contemplate`: the learned parameters a ConFu drafter model holds (``Contemplation``: the
  soft prompt, the contemplate embeddings and their router, the future input map) and the test
  ``is_confu_drafter``. They stay in ``models`` because the attached-drafter format (:mod:`speculant.models.attached`)
  saves and loads them with the drafter's weights, and the drafters' registry tells a ConFu drafter model from an
  EAGLE-3 one by them; neither ``models`` nor ``drafters`` may import a package above them.
- :mod:`speculant.drafters.confu`: the drafter (``ConFuDrafter``, ``ConFuTreeDrafter``, ``confu_variant``). It stays
  in ``drafters`` because the method registry (:mod:`speculant.drafters.registry`) builds it for the ``confu``
  method and for every draft-model method given a ConFu drafter, as it builds EAGLE-3's feature drafters.
- :mod:`.training`: the training objective (``ConFuObjective``: EAGLE-3's objective plus the contemplate tokens,
  anchor sampling and future-prediction replication), used by ``speculant train draft --kind confu``.

This package sits at the training layer, beside :mod:`speculant.train`: nothing in ``core``, ``models`` or
``drafters`` imports it.
"""
