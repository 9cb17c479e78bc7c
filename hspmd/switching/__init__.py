"""hspmd.switching"""
