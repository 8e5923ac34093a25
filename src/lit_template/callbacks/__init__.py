"""The template's own callbacks; each one is a file here and a yaml in conf/callbacks/."""
