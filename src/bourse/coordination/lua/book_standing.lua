-- ARGV[5]: a book member ('' for none): the level and the orders ahead of it
local rank = -1
if ARGV[5] ~= '' then rank = redis.call('ZRANK', book, ARGV[5]) or -1 end
return {level(), rank}
