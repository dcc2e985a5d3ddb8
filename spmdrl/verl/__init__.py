"""verl compatibility: its command lines and YAML (``args``), its keys mapped onto spmdrl's (``compat``), and
the generated docs/verl.md (``docs``)."""
