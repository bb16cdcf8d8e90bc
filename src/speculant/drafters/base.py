"""The drafter interface: :class:`Drafter` (the protocol ``begin``/``propose``/``commit`` and the declared
capabilities ``uses_target_hidden``, ``target_taps``, ``model``, ``params_per_forward``), :class:`DecodeState`
and :func:`capability`.

They are defined in :mod:`speculant.core.drafting`, because the engine (``core``) drives drafters and must not
import from this package; drafters import them from here. Subclass :class:`Drafter` and override the
capabilities your drafter has; a class with only the three protocol methods works too (the defaults apply).
"""

from __future__ import annotations

from ..core.drafting import CAPABILITIES, DecodeState, Drafter, capability

__all__ = ["CAPABILITIES", "DecodeState", "Drafter", "capability"]
