"""Dataset validation on the login node, before any GPU is spent (`ft validate`, `ft data check`)."""
