"""The `omniserve` command line (audit, bench, golden, generate, verify, health), its HTTP client and the `make serve`
launcher. Nothing served imports them."""
