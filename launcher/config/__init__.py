"""`launcher-config`: discover the cables between hosts, plan their addresses, write the hostfile."""
