"""hspmd.ops"""
