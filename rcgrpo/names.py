"""Names that the settings share with the modules that use them, in a module
without imports: rcgrpo.config takes them from here, so that validating a
config does not import what those modules need (rcgrpo.prompts: torch)."""

# How the function docs are written into the system prompt (rcgrpo/prompts.py).
DOC_STYLES = ("compact", "compact_no_response", "official")
