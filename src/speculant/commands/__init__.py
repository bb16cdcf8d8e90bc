"""The subcommands of ``speculant``, one module each: :mod:`.generate`, :mod:`.train`, :mod:`.bench`,
:mod:`.kv_eval`; :mod:`.common` holds what they share (the one-line-error parser, option types, ``--device``...).

A command module declares ``DESCRIPTION``, ``add_arguments(parser)``, ``run(args) -> exit code`` and optionally
``epilog()``; :data:`speculant.cli.COMMANDS` names it and imports it only when its subcommand is chosen, so
``speculant --help`` needs no torch. Nothing here imports :mod:`speculant.cli`.
"""
