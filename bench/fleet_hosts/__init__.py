"""Phase `fleet_hosts`: a fleet of two servers on two other hosts beside the same fleet on this
host (bench/fleet_hosts/phase.py)."""
