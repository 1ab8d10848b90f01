"""Built-in hardware profiles, one TOML file each (format: docs/hwprofile-format.md)."""
