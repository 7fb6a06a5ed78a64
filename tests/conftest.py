"""Settings for the whole suite."""
from hypothesis import settings

# No test has a wall-clock limit (the machines are shared and noisy):
# hypothesis's default 200 ms deadline per example is turned off everywhere.
settings.register_profile("rcgrpo", deadline=None)
settings.load_profile("rcgrpo")
