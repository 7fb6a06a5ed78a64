"""The floor every other package stands on: one-line user errors
(``errors``), atomic writes (``atomic``), reading untrusted JSON
(``json_input``), the process group (``distributed``), the command-line
convention (``command_line``), the names of stages and pipelines
(``stages``) and what the host has (``host``: memory, disk).

May import: the standard library, torch, and nothing else of rcgrpo.
"""
