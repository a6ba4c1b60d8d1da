"""The command line and systemd: run/consumer/producer processes, sd_notify, units under a real systemd."""
