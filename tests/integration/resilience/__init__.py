"""Nothing lost: chaos (kills), soak, checkpoint/resume, bad cache files."""
