"""Standard-library code that both the launcher and the adapter run, so that they apply one
rule where they must agree (e.g. which secret files are private enough). Imports nothing of
either: the launcher never imports the adapter's backends, the backends never the launcher."""
