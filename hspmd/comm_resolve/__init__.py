"""hspmd.comm_resolve"""
